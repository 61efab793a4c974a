"""shardtune sweep --search: a search of real trials whose values are the trials' own validation
losses; the study logic (TPE over 6 trials, pruning, resuming past a killed worker's trial,
outputs) on stand-in trials that write metrics.jsonl as training does; stopping a running trial;
bad input refused before any trial."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_overrides
from shardtune.cli.main import main
from shardtune.config.schema import config_keys
from shardtune.sweep import search as search_lib
from shardtune.sweep import space
from shardtune.sweep.trial import _wait

PNG = b"\x89PNG\r\n\x1a\n"


def overrides(assets, tmp_path, searched: str = "train.lr") -> list[str]:
    """The tiny run's overrides, less those each trial sets (refused: the trial would replace them)."""
    return [w for w in tiny_overrides(assets, tmp_path / "unused")
            if w.partition("=")[0] not in ("output_dir", "train.max_steps", searched)]


def csv_rows(out: Path) -> list[dict]:
    with open(out / "search.csv") as f:
        return list(csv.DictReader(f))


def test_a_search_trial_is_a_real_train_run(assets, tmp_path, capsys, monkeypatch):
    """One real trial (each costs a process start): its value is the validation loss its train
    process logged. The search logic over many trials is tested on stand-in trials below."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the trial process inherits it: 2 shared cores
    out = tmp_path / "search"
    code = main(["sweep", *overrides(assets, tmp_path), "--search", "train.lr=loguniform:1e-5:3e-2", "--trials", "1",
                 "--pruner", "none", "--steps", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    (row,) = csv_rows(out)
    logged = [json.loads(line) for line in (out / "trials" / "trial-0000" / "metrics.jsonl").read_text().splitlines()]
    assert row["state"] == "complete" and row["last_step"] == "2"
    assert float(row["value"]) == pytest.approx([x["eval_loss"] for x in logged if "eval_loss" in x][-1])
    assert f"train.lr={row['train.lr']}" in (out / "search.md").read_text()  # the ready command line


def fake_trials(monkeypatch, calls: list):
    """run_trial as a stand-in: metrics.jsonl rows like a training run's, validation loss every 2
    steps falling faster the closer log10(lr) is to -2.5; the watch reads them as it reads a live run's."""

    def run_trial(sweep, point, name, cap, micro_batch=None, watch=None, checkpointing=None):
        calls.append(name)
        folder = sweep.out / "trials" / name
        folder.mkdir(parents=True, exist_ok=True)
        lr = float(point["train.lr"])
        with open(folder / "metrics.jsonl", "w") as f:
            for step in range(2, sweep.steps + 1, 2):
                f.write(json.dumps({"step": step, "eval_loss": 5 + (math.log10(lr) + 2.5) ** 2 - 0.1 * step}) + "\n")
        pruned = watch(folder)
        return {"name": name, "point": point, "seconds": 0.1, "exit_code": 0,
                "status": "pruned" if pruned else "ok", **({"note": "stopped early"} if pruned else {})}

    monkeypatch.setattr(search_lib, "run_trial", run_trial)


def test_study_prunes_resumes_and_draws(assets, tmp_path, monkeypatch, capsys):
    calls = []
    fake_trials(monkeypatch, calls)
    out = tmp_path / "search"
    argv = ["sweep", *overrides(assets, tmp_path), "--search", "train.lr=loguniform:1e-5:1e-1", "--steps", "8",
            "--eval-steps", "2", "--out", str(out)]
    assert main([*argv, "--trials", "3"]) == 0  # a search stopped after 3 trials
    import optuna

    study = optuna.load_study(study_name="search", storage=f"sqlite:///{out / 'study.db'}")
    study.ask()  # a worker killed mid-trial leaves its trial RUNNING
    before = {t.number: (t.params, t.value) for t in study.get_trials() if t.state.name == "COMPLETE"}
    assert main([*argv, "--trials", "6"]) == 0
    assert len(calls) == 6 and len(set(calls)) == 6  # the first 3 were not run again
    study = optuna.load_study(study_name="search", storage=f"sqlite:///{out / 'study.db'}")
    states = [t.state.name for t in study.get_trials()]
    assert sum(s in ("COMPLETE", "PRUNED") for s in states) == 6 and states.count("RUNNING") == 1
    assert "PRUNED" in states  # the median pruner stopped a trial that was worse at the same step
    assert {t.number: (t.params, t.value) for t in study.get_trials() if t.number in before} == before
    complete = [t.value for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert study.best_value == min(complete) < max(complete)
    for stem in ("history", "importance", "param-train_lr"):
        assert (out / f"{stem}.png").read_bytes()[:8] == PNG
    import matplotlib

    assert matplotlib.rcParams["axes.facecolor"] == "white"  # optuna's ggplot style stayed inside its plots
    assert "best: trial" in (out / "search.md").read_text()
    assert len(csv_rows(out)) == 7
    # the same folder with another search space is another study: refused
    capsys.readouterr()
    assert main([*argv[:-4], "--search", "train.seed=int:0:3", "--out", str(out)]) == 2
    assert "another space" in capsys.readouterr().err


def test_an_interrupted_trial_is_not_counted_as_a_finished_one(assets, tmp_path, monkeypatch):
    """Ctrl-C during a trial: optuna marks it failed, and a rerun counted it towards --trials (a
    search of 3 ran 2, the table said the interrupted values failed); another runs in its place."""
    calls = []
    fake_trials(monkeypatch, calls)
    fake = search_lib.run_trial

    def interrupted_second(*args, **kwargs):
        if len(calls) == 1:
            calls.append("interrupted")
            raise KeyboardInterrupt
        return fake(*args, **kwargs)

    monkeypatch.setattr(search_lib, "run_trial", interrupted_second)
    monkeypatch.setattr("shardtune.sweep.grid.check_models", lambda *args: None)  # seconds, and not this test's
    monkeypatch.setattr("shardtune.sweep.search_report.draw", lambda *args: [])
    out = tmp_path / "search"
    argv = ["sweep", *overrides(assets, tmp_path), "--search", "train.lr=loguniform:1e-5:1e-1", "--steps", "2",
            "--trials", "3", "--pruner", "none", "--out", str(out)]
    assert main(argv) != 0 and calls == ["trial-0000", "interrupted"]
    assert main(argv) == 0
    assert calls[2:] == ["trial-0002", "trial-0003"]  # the interrupted trial 1 is not one of the 3
    assert [(r["state"], r["note"]) for r in csv_rows(out)] == [
        ("complete", ""), ("fail", "interrupted: not counted"), ("complete", ""), ("complete", "")]


def test_search_without_optuna_names_its_extra(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed
    code = main(["sweep", *overrides(assets, tmp_path), "--search", "train.lr=uniform:0.1:0.2", "--out",
                 str(tmp_path / "s")])
    assert code == 2 and "pip install 'shardtune[tune]'" in capsys.readouterr().err


def test_a_storage_of_another_schema_is_one_line(assets, tmp_path, monkeypatch, capsys):
    """A database that opens but is not Optuna's (a `studies` table of its own) was a traceback of
    optuna's StorageInternalError; it is one line, and the database's own rows are kept."""
    import sqlite3

    calls = []
    fake_trials(monkeypatch, calls)
    db = tmp_path / "mine.db"
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("create table studies (x integer)")
        con.execute("insert into studies values (7)")
        con.commit()
    code = main(["sweep", *overrides(assets, tmp_path), "--search", "train.lr=uniform:0.1:0.2", "--storage",
                 f"sqlite:///{db}", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot use study 's' in --storage" in err[0], err
    assert "OperationalError: " in err[0] and "column" in err[0] and calls == []  # the database's own reason
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute("select x from studies").fetchall() == [(7,)]


def one_trial_study(assets, tmp_path, monkeypatch) -> tuple[list, Path, list[str], bytes]:
    """A finished study of one stand-in trial in OUT: (the trials run, OUT, its argv, its trial 0's metrics)."""
    calls = []
    fake_trials(monkeypatch, calls)
    out = tmp_path / "search"
    argv = ["sweep", *overrides(assets, tmp_path), "--search", "train.lr=loguniform:1e-5:1e-1", "--steps", "2",
            "--trials", "1", "--out", str(out)]
    assert main(argv) == 0
    return calls, out, argv, (out / "trials" / "trial-0000" / "metrics.jsonl").read_bytes()


def test_another_study_in_the_same_folder_keeps_the_first_ones_trials(assets, tmp_path, monkeypatch):
    """Trial numbers start at 0 in every study: a second --study-name in the same --out reran
    trials/trial-0000 over the first study's (each trial overwrites its folder)."""
    calls, out, argv, first = one_trial_study(assets, tmp_path, monkeypatch)
    assert main([*argv, "--study-name", "other"]) == 0
    assert main([*argv, "--study-name", "an other/one"]) == 0
    assert calls[:2] == ["trial-0000", "trial-0000-other"] and calls[2].startswith("trial-0000-anotherone-")
    assert (out / "trials" / "trial-0000" / "metrics.jsonl").read_bytes() == first


def test_a_new_study_over_another_studys_trial_folders_is_refused(assets, tmp_path, monkeypatch, capsys):
    """Another --storage (or the folder's study.db removed) is a new study of the same name: its
    trial 0 emptied and rewrote trials/trial-0000 of the first."""
    calls, out, argv, first = one_trial_study(assets, tmp_path, monkeypatch)
    capsys.readouterr()
    for extra in (["--storage", f"sqlite:///{tmp_path / 'other.db'}"], []):
        if not extra:
            (out / "study.db").unlink()
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert "holds 1 trial folder(s) of a study 'search' that --storage" in err and len(err.splitlines()) == 1
    assert calls == ["trial-0000"] and (out / "trials" / "trial-0000" / "metrics.jsonl").read_bytes() == first


def test_a_pruned_trial_process_is_stopped(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.perf_counter()
    code, pruned = _wait(proc, tmp_path, lambda folder: True)
    assert pruned and code != 0 and time.perf_counter() - start < 10


@pytest.mark.parametrize("extra, needle", [
    (["--search", "train.lr=normal:1:2"], "unknown distribution 'normal'"),
    (["--search", "train.lr=loguniform:0:1e-3"], "LOW > 0"),
    (["--search", "train.lr=uniform:3:1"], "LOW must be below HIGH"),
    (["--search", "train.lr=int:a:3"], "two int bounds"),
    (["--search", "train.nope=uniform:1:2"], "unknown config key 'train.nope'"),
    (["--search", "train.lr=uniform:0.1:0.2", "--sampler", "grid"], "unknown --sampler 'grid'"),
    (["--search", "train.lr=uniform:0.1:0.2", "--pruner", "x"], "unknown --pruner 'x'"),
    (["--search", "train.lr=uniform:0.1:0.2", "--objective", "bleu"], "unknown --objective 'bleu'"),
    (["--search", "train.lr=uniform:0.1:0.2", "--trials", "0"], "--trials: must be at least 1"),
    (["--search", "data.path=uniform:1:2"], "data.path is not a number"),
    (["--search", "model.config=int:1:2"], "model.config is not a number"),
    (["--search", "train.warmup_steps=uniform:1:9"], "train.warmup_steps is a whole number and uniform draws"),
    (["--search", "train.micro_batch_size=loguniform:1:9"], "is a whole number"),
    (["--search", "train.lr=uniform:0.1:0.2", "--study-name", ""], "--study-name: must not be empty"),
    (["--search", "train.lr=uniform:0.1:0.2", "--storage", "nosuchdb://x"], "cannot open --storage"),
    (["--search", "train.lr=uniform:0.1:0.2", "--grid", "train.seed=1,2"], "two kinds of sweep"),
    # a key the sweep sets for each trial: every point the same run
    (["--search", "train.max_steps=int:1:3"], "--search train.max_steps is set per trial by --steps; sweep other"),
    (["--search", "eval.at_start=choice:true,false"], "eval.at_start is set per trial by the sweep (it measures"),
    # what the grid refuses of each point, refused of each corner (it ran every trial to its failure)
    (["--search", "train.lr=uniform:0.1:0.2", "kernels=liger"], "train.lr=0.1: kernels=liger needs a CUDA GPU"),
    (["--search", "train.global_batch_size=choice:8,10", "--search", "train.weight_decay=uniform:0:0.1", "--nproc",
      "2"],
     "--search train.global_batch_size=10: train.global_batch_size=10 is not divisible by micro_batch_size x ranks"),
    # two choices that load as one run (as the grid refuses train.lr=1e-3,0.001): trials of one value
    (["--search", "train.lr=choice:1e-3,0.001,0.01"], "--search train.lr=0.001: it is the same run as train.lr=1e-3"),
    # a value inside the range that the bounds' check let through: a failed trial each time it was drawn
    (["--search", "train.micro_batch_size=int:1:4"], "--search train.micro_batch_size=3: train.global_batch_size=8 "
     "is not a multiple of train.micro_batch_size=3"),
    # a micro-batch the planner picks: a traceback (the world check multiplied "auto")
    (["--search", "train.lr=uniform:0.1:0.2", "train.micro_batch_size=auto", "--nproc", "3"],
     "train.micro_batch_size=auto keeps train.global_batch_size=8, which 3 ranks do not divide"),
])
def test_bad_search_input_is_one_line_before_any_trial(assets, tmp_path, monkeypatch, capsys, extra, needle):
    calls = []
    fake_trials(monkeypatch, calls)
    searched = extra[extra.index("--search") + 1].partition("=")[0]
    code = main(["sweep", *overrides(assets, tmp_path, searched), *extra, "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert calls == []


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(config_keys()), kind=st.sampled_from(["uniform", "loguniform", "int", "logint"]),
       low=st.integers(1, 50), span=st.integers(1, 50), share=st.floats(0, 1))
def test_a_searched_number_loads_as_the_keys_type_or_is_refused_first(key, kind, low, span, share):
    """Over every key of the schema: a numeric distribution the space check lets through draws
    values that load as a number of the key's type, never as text (a path of 1.7)."""
    from shardtune.config.load import load_config
    from shardtune.errors import UserError

    param = space.Param(key, kind, low, low + span)
    try:
        space.check_kind(param)
    except UserError as exc:
        assert key in str(exc) and "\n" not in str(exc)
        return
    drawn = low + span * share
    value = round(drawn) if kind in ("int", "logint") else drawn
    try:
        cfg = load_config(None, [f"{key}={value}"])
    except UserError:
        return  # out of the key's range: the values' check refuses such a space before trial 1
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert isinstance(node, (int, float)) and not isinstance(node, bool), (key, node)


def test_a_resumed_search_draws_new_values_and_the_same_as_one_run(assets, tmp_path, monkeypatch):
    """The sampler was seeded once per process: a rerun continuing a search (and a second machine
    on the same --storage) drew the first trials' values again (TPE's random start-up trials, as
    --sampler random's).
    Trial N's draw follows from --seed and N: a search resumed gives the values of one run in one go."""
    fake_trials(monkeypatch, [])
    monkeypatch.setattr("shardtune.sweep.grid.check_models", lambda *args: None)  # seconds, and not this test's
    monkeypatch.setattr("shardtune.sweep.search_report.draw", lambda *args: [])

    def search(out: Path, trials: int) -> list[str]:
        argv = ["sweep", *overrides(assets, tmp_path), "--search", "train.lr=loguniform:1e-5:1e-1", "--steps", "2",
                "--trials", str(trials), "--pruner", "none", "--out", str(out)]
        assert main(argv) == 0
        return [r["train.lr"] for r in csv_rows(out)]

    search(tmp_path / "resumed", 1)
    resumed = search(tmp_path / "resumed", 3)
    assert len(set(resumed)) == 3, resumed
    assert search(tmp_path / "at-once", 3) == resumed


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(st.floats(0.5, 0.999), st.floats(0.5, 0.999)), min_size=2, max_size=4, unique=True))
def test_a_choice_of_lists_is_one_choice_per_list(pairs):
    """choice:[0.9,0.95],[0.9,0.99] was split at every comma: refused as repeating a value, or four
    choices of half a list each. Split as the grid's values are, each list is one choice and loads as it."""
    from shardtune.config.load import load_config

    words = [f"[{a},{b}]" for a, b in pairs]
    param = space.parse_param(f"train.betas=choice:{','.join(words)}")
    assert param.choices == words
    for word, pair in zip(param.choices, pairs, strict=True):
        cfg = load_config(None, ["model.name_or_path=gpt2", "data.path=x", f"train.betas={word}"])
        assert list(cfg.train.betas) == list(pair)


def test_a_searched_auto_layout_is_resolved_within_the_memory_limit(assets, tmp_path, monkeypatch):
    """train.micro_batch_size=auto (and activation_checkpointing=auto) in a search: each trial chose
    them itself against the machine's free RAM, not --mem-limit (which caps it), and ran out of the cap;
    the search resolves them within the limit per trial, as the grid does, and hands them to the trial."""
    from shardtune.plan import fit

    fake_trials(monkeypatch, [])
    fake, seen, budgets = search_lib.run_trial, [], []

    def run_trial(sweep, point, name, cap, micro_batch=None, watch=None, checkpointing=None):
        seen.append((cap, micro_batch, checkpointing))
        return fake(sweep, point, name, cap, micro_batch, watch)

    def resolved(cfg, world, local, host_budget=None):
        budgets.append(host_budget)
        return 2, "selective", "auto: micro-batch 2, selective"

    monkeypatch.setattr(search_lib, "run_trial", run_trial)
    monkeypatch.setattr(fit, "resolve_layout", resolved)
    monkeypatch.setattr("shardtune.sweep.grid.check_models", lambda *args: None)  # seconds, and not this test's
    monkeypatch.setattr("shardtune.sweep.search_report.draw", lambda *args: [])
    argv = ["sweep", *overrides(assets, tmp_path), "train.micro_batch_size=auto", "activation_checkpointing=auto",
            "--search", "train.lr=loguniform:1e-5:1e-1", "--steps", "2", "--trials", "1", "--mem-limit", "3GiB",
            "--out", str(tmp_path / "search")]
    assert main(argv) == 0
    assert seen == [(3 << 30, 2, "selective")]
    assert budgets and 0 < budgets[0] < 3 << 30  # the limit, less what the process holds beside its tensors


def test_a_trial_without_a_finite_value_fails_saying_why(assets, tmp_path, monkeypatch):
    """A trial whose validation loss is NaN was failed by optuna with nothing in search.csv's note, as
    was one that logged no validation loss; neither is the best, and the note says why."""
    calls = []
    fake_trials(monkeypatch, calls)
    fake = search_lib.run_trial

    def diverged_then_silent(sweep, point, name, cap, micro_batch=None, watch=None, checkpointing=None):
        record = fake(sweep, point, name, cap, micro_batch, watch)
        rows = {"trial-0000": [{"step": 2, "eval_loss": math.nan}], "trial-0001": [{"step": 2, "loss": 3.0}]}
        if name in rows:
            lines = "".join(json.dumps(r) + "\n" for r in rows[name])
            (sweep.out / "trials" / name / "metrics.jsonl").write_text(lines)
        return record

    monkeypatch.setattr(search_lib, "run_trial", diverged_then_silent)
    monkeypatch.setattr("shardtune.sweep.grid.check_models", lambda *args: None)  # seconds, and not this test's
    monkeypatch.setattr("shardtune.sweep.search_report.draw", lambda *args: [])
    out = tmp_path / "search"
    assert main(["sweep", *overrides(assets, tmp_path), "--search", "train.lr=loguniform:1e-5:1e-1", "--steps", "2",
                 "--trials", "3", "--pruner", "none", "--out", str(out)]) == 0
    assert [(r["state"], r["note"]) for r in csv_rows(out)] == [
        ("fail", "eval_loss is nan: the run diverged"),
        ("fail", "the trial logged no eval_loss; does the data have a validation split?"), ("complete", "")]
    assert "best: trial 2" in (out / "search.md").read_text()
