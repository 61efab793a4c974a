"""shardtune sweep: a 2x2 grid of real trials and its outputs, resuming, the max-batch search
under a real memory cap (with a crashing grid point beside it), and bad input."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY, child_env, run_cli, tiny_overrides
from shardtune.cli.main import main
from shardtune.config.load import dump_yaml, load_config
from shardtune.sweep.max_batch import search_max_batch, seed_index
from shardtune.sweep.report import _size, slug
from shardtune.sweep.trial import CAPPED_ENV

PNG = b"\x89PNG\r\n\x1a\n"
GRID = ["--grid", "fsdp.sharding=full_shard,no_shard", "--grid", "activation_checkpointing=false,true"]


def write_recipe(assets, folder, **extra):
    overrides = [w for w in tiny_overrides(assets, folder / "unused", **extra) if not w.startswith("output_dir=")]
    path = folder / "recipe.yaml"
    path.write_text(dump_yaml(load_config(None, overrides, defaults={})))
    return path


def rows(out):
    with open(out / "sweep.csv") as f:
        return list(csv.DictReader(f))


def sweep_cli(args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `shardtune sweep ARGS` run in this process, in the environment
    a child of run_cli has (one thread each); its trials are processes of their own, as ever. A
    sweep process of its own would only add a start of torch and transformers (seconds)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr(os, "environ", child_env())
        code = main(["sweep", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def grid_sweep(assets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    model = {**TINY["gpt2"], "vocab_size": 300}  # the tokenizer's size, which the planner reads from here
    recipe = write_recipe(assets, folder, **{"model.config": json.dumps(model)})
    out = folder / "out"
    code, _, err = sweep_cli([str(recipe), *GRID, "--steps", "2", "--eval-steps", "2", "--out", str(out)])
    assert code == 0, err[-3000:]
    return recipe, out


def test_a_grid_of_real_trials_writes_csv_table_and_plots(grid_sweep):
    _, out = grid_sweep
    table = rows(out)
    assert [(r["fsdp.sharding"], r["activation_checkpointing"]) for r in table] == [
        ("full_shard", "false"), ("full_shard", "true"), ("no_shard", "false"), ("no_shard", "true")]
    for r in table:
        assert r["status"] == "ok" and r["micro_batch"] == "2" and r["accumulation"] == "4"  # global 8 kept
        assert float(r["tokens_per_s"]) > 0 and float(r["step_time_s"]) > 0 and float(r["eval_ppl"]) > 1
        # live tensors are a small part of the process (libraries), and the planner predicted them
        assert 0 < float(r["mem_live_gib"]) < float(r["mem_rss_gib"])
        assert 0.5 < float(r["predicted_gib"]) / float(r["mem_live_gib"]) < 2
        assert not (out / "trials" / r["name"] / "final").exists()  # trials keep no model
    by_ac = {r["activation_checkpointing"]: float(r["mem_live_gib"]) for r in table if r["fsdp.sharding"] == "no_shard"}
    assert by_ac["true"] < by_ac["false"]  # recomputation holds fewer activations
    md = (out / "sweep.md").read_text()
    assert "| method | micro-batch | accumulation | tokens/s | step time | peak memory |" in md
    assert "| sharding=no_shard, activation_checkpointing=true | 2 | 4 |" in md and "perplexity" in md
    for stem in ("throughput", "memory", "predicted_vs_measured"):
        assert (out / f"{stem}.png").read_bytes()[:8] == PNG and f"({stem}.png)" in md


def test_a_rerun_skips_finished_trials_and_reruns_the_interrupted_one(grid_sweep):
    recipe, out = grid_sweep
    state = json.loads((out / "sweep.json").read_text())
    names = list(state["trials"])
    interrupted = names[1]
    del state["trials"][interrupted]  # as if the sweep had stopped during that trial
    (out / "sweep.json").write_text(json.dumps(state))
    kept = {n: (out / "trials" / n / "metrics.jsonl").stat().st_mtime_ns for n in names if n != interrupted}
    code, stdout, err = sweep_cli([str(recipe), *GRID, "--steps", "2", "--eval-steps", "2", "--out", str(out)])
    assert code == 0, err[-3000:]
    assert "(3 trial(s) already done)" in stdout
    ran = [line.split(":")[0].strip() for line in stdout.splitlines() if line.startswith("  ")]
    assert ran == [interrupted]
    assert {n: (out / "trials" / n / "metrics.jsonl").stat().st_mtime_ns for n in kept} == kept
    assert len(rows(out)) == 4 and all(r["status"] == "ok" for r in rows(out))


def test_a_rerun_with_another_grid_is_refused(grid_sweep, capsys):
    recipe, out = grid_sweep
    before = (out / "sweep.json").read_text()
    code = main(["sweep", str(recipe), "--grid", "fsdp.sharding=full_shard", "--steps", "2", "--eval-steps", "2",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "holds a sweep with another grid" in err
    assert (out / "sweep.json").read_text() == before


def libraries_mib() -> int:
    """The data segment of a process that loaded what a trial loads, before any tensor: the cap
    holds it too. torch's CUDA builds (2.11+cu130 on the GPU machine) map ~550 MiB more there
    than the CPU build, even on a CPU."""
    code = ("import datasets, shardtune.train.trainer\n"
            "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('VmData')][0])\n"
            "import os, sys; sys.stdout.flush(); os._exit(0)")  # no teardown: seconds with torch loaded
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=child_env(**CAPPED_ENV))
    return int(probe.stdout) // 1024


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_max_batch_search_finds_the_boundary_under_a_real_memory_cap(assets, tmp_path):
    """A 4-layer GPT-2 whose activations dominate: under a cap on each trial's data segment of
    630 MiB above the libraries' (about 950 MiB in all with torch's CPU build), the largest
    micro-batch that runs is found in few trials, the next one up fails with a real out-of-memory,
    and a grid point that crashes for another reason is recorded as such while the other completes."""
    model = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 128, "vocab_size": 300}
    recipe = write_recipe(assets, tmp_path, **{"model.config": json.dumps(model), "data.seq_len": 128,
                                                "train.global_batch_size": 32, "train.micro_batch_size": 16})
    out = tmp_path / "out"
    cap = libraries_mib() + 630
    # a process of its own: before its first trial, the search's budget counts what the sweep's own
    # process holds (its peak RSS), which in a test worker is every earlier test's
    result = run_cli(["sweep", str(recipe), "--grid", "model.config.n_head=4,3", "--max-batch", "--mem-limit",
                      f"{cap}MiB", "--steps", "1", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    trials = {(r["model.config.n_head"], int(r["micro_batch"])): r for r in rows(out)}
    fits = [mb for (heads, mb), r in trials.items() if heads == "4" and r["status"] == "ok"]
    too_big = [mb for (heads, mb), r in trials.items() if heads == "4" and r["status"] == "oom"]
    assert fits and too_big and len(fits) + len(too_big) <= 3  # seeded by the planner: few trials
    best = max(fits)
    assert 1 < best < 32 and min(too_big) == 2 * best  # candidates are the divisors of 32: a real boundary
    assert "allocate memory" in trials[("4", 2 * best)]["note"]
    crashed = [r for (heads, _), r in trials.items() if heads == "3"]
    assert len(crashed) == 1 and crashed[0]["status"] == "failed" and "ValueError" in crashed[0]["note"]
    md = (out / "sweep.md").read_text()
    assert f"| n_head=4 | {best} |" in md and f"mb {2 * best}: oom" in md
    assert f"limit {_size(cap / 1024)} per rank" in md
    assert "stopped: a trial crashed (not memory)" in md


def test_the_search_probes_few_micro_batches():
    candidates = [1, 2, 4, 8, 16, 32, 64, 128]

    def search(seed, largest_fit, broken=()):
        tried = []

        def attempt(mb):
            tried.append(mb)
            return "broken" if mb in broken else "fits" if mb <= largest_fit else "too_big"

        return search_max_batch(candidates, seed, attempt), tried

    assert search(3, 8) == ((8, "boundary"), [8, 16])  # a good seed: the seed, one step up
    assert search(5, 8) == ((8, "boundary"), [32, 16, 4, 8])  # too high: one step down, then two, then bisect
    assert search(0, 64) == ((64, "boundary"), [1, 2, 8, 128, 32, 64])  # climbs 1, 2, 4 steps, then bisects
    assert search(6, 128) == ((128, "all fit"), [64, 128])
    assert search(2, 0) == ((None, "none fits"), [4, 2, 1])
    assert search(2, 64, broken={8}) == ((4, "broken"), [4, 8])
    # a seed that was too careful: the first trial's measurement moves the next one straight up
    assert search_max_batch(candidates, 2, lambda mb: "fits" if mb <= 16 else "too_big", lambda: 4) == (16, "boundary")
    tried = []
    search_max_batch(candidates, 2, lambda mb: tried.append(mb) or ("fits" if mb <= 16 else "too_big"), lambda: 4)
    assert tried == [4, 16, 32]
    # the seed: the largest candidate whose prediction fits; without one, the recipe's micro-batch
    assert seed_index(candidates, 16, 1000, lambda mb: 100 * mb) == 3
    assert seed_index(candidates, 16, None, lambda mb: 100 * mb) == 4
    assert seed_index(candidates, 16, 50, lambda mb: 100 * mb) == 0
    # a size the planner cannot predict (None) is not taken for one that fits: no TypeError either
    assert seed_index(candidates, 16, 1000, lambda mb: 100 * mb if mb <= 4 else None) == 2


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), boundary=st.integers(0, 12), seed=st.integers(0, 11),
       better=st.none() | st.integers(-2, 14))
def test_the_search_finds_the_boundary_of_any_monotone_pattern(data, n, boundary, seed, better):
    """Any candidates, seed and reseed: the largest fitting micro-batch (at the first or the last
    candidate too), each tried once, few trials; a broken candidate ends the search at a true fit."""
    candidates = sorted(data.draw(st.sets(st.integers(1, 512), min_size=n, max_size=n)))
    boundary, seed = min(boundary, n), min(seed, n - 1)
    broken = data.draw(st.none() | st.sampled_from(candidates))
    tried = []

    def attempt(mb):
        assert mb not in tried
        tried.append(mb)
        return "broken" if mb == broken else "fits" if candidates.index(mb) < boundary else "too_big"

    best, why = search_max_batch(candidates, seed, attempt, lambda: better)
    truth = candidates[boundary - 1] if boundary else None
    if broken in tried:
        assert why == "broken" and (best is None or best <= (truth or 0))
    else:
        assert (best, why) == (truth, "none fits" if not boundary else "all fit" if boundary == n else "boundary")
        assert len(tried) <= 2 * n.bit_length() + 2


def test_every_grid_point_has_its_own_trial_name():
    """A name cut at 150 characters (six keys) or stripped of '/' made two points one trial: the
    second point was "already done" and the table showed the first point's numbers for it."""
    six = {"fsdp.sharding": "full_shard", "activation_checkpointing": "true", "model.config.num_hidden_layers": "2",
           "train.optimizer": "adamw", "fsdp.reshard_after_forward": "true", "precision": "bf16"}
    pairs = [(six, {**six, "precision": "fp32"}), ({"data.path": "/a/b.json"}, {"data.path": "/ab.json"}),
             ({"train.betas": "[0.9,0.95]"}, {"train.betas": "0.9-0.95"})]
    for a, b in pairs:
        assert slug(a) != slug(b) and re.fullmatch(r"[A-Za-z0-9_.-]{1,160}", slug(a)), (slug(a), slug(b))
    assert slug({"precision": "bf16"}) == "precision-bf16"  # a plain point keeps its readable name


@pytest.mark.parametrize("auto", [["train.micro_batch_size=auto", "activation_checkpointing=auto"],
                                  ["activation_checkpointing=auto"]])
def test_an_auto_layout_is_resolved_within_the_memory_limit_and_handed_to_the_trial(assets, tmp_path, monkeypatch,
                                                                                     auto):
    """The sweep resolves activation_checkpointing=auto with the micro-batch, within --mem-limit, and
    the trial runs that mode: left to the trial, it was chosen against the machine's free RAM."""
    from shardtune.plan import fit
    from shardtune.sweep.grid import Sweep
    from shardtune.sweep.max_batch import auto_layout

    budgets = []

    def resolved(cfg, world, local, host_budget=None):
        assert (cfg.device, cfg.compile) == ("cpu", False)  # planned as the trial will run: resolved as train resolves
        budgets.append(host_budget)
        return 2, "selective", "auto: micro-batch 2, selective"

    monkeypatch.setattr(fit, "resolve_layout", resolved)
    sweep = Sweep(None, [*tiny_overrides(assets, tmp_path / "unused"), *auto], [], mem_limit=3 << 30,
                  out=tmp_path / "out", defaults={})
    micro_batch, mode = auto_layout(sweep, {}, sweep.mem_limit, [])
    assert mode == "selective" and micro_batch == (2 if len(auto) == 2 else None)
    assert budgets[0] is not None and budgets[0] < sweep.mem_limit  # the limit, less what the process holds
    cfg = sweep.config({}, micro_batch, mode)
    assert cfg.activation_checkpointing == "selective" and cfg.train.micro_batch_size != "auto"


@pytest.mark.parametrize("args, message", [
    (["--grid", "fsdp.shardng=full_shard,no_shard"], "unknown config key 'fsdp.shardng'; did you mean fsdp.sharding"),
    (["--grid", "fsdp.sharding=full_shard,sideways"], "fsdp.sharding='sideways' is not a valid choice"),
    (["--grid", "fsdp.sharding="], "is not KEY=V1,V2"),
    (["--grid", "precision=bf16", "--grid", "precision=fp32"], "precision is given twice"),
    ([], "nothing to sweep"),
    (["--grid", "precision=bf16,fp32", "--steps", "0"], "--steps: must be at least 1"),
    (["--grid", "train.micro_batch_size=2,3"], "train.micro_batch_size=3"),
    (["--grid", "precision=bf16", "--nproc", "3"], "not divisible by micro_batch_size x ranks = 2 x 3"),
    # no grid: the recipe's own line, not one of a "--grid :" point that was never given
    (["--max-batch", "--nproc", "3"], "error: train.global_batch_size=8 is not divisible by --nproc 3"),
    (["--grid", "output_dir=a,b"], "--grid output_dir is set per trial by --out"),
    # a key the sweep sets for each trial, or values that mean the same: every point the same run
    (["--grid", "train.max_steps=1,2"], "--grid train.max_steps is set per trial by --steps; sweep other keys"),
    (["--grid", "log.every_steps=5,10"], "log.every_steps is set per trial by the sweep (it measures every step"),
    (["--grid", "train.lr=1e-3,0.001"], "train.lr=0.001: it is the same run as --grid train.lr=1e-3"),
    (["device=cpu", "--grid", "compile=auto,false"], "compile=false: it is the same run as --grid compile=auto"),
    (["--max-batch", "--grid", "train.micro_batch_size=1,2"], "micro_batch_size is set per trial by --max-batch"),
    (["--grid", "precision=bf16", "--mem-limit", "lots"], "is not a memory size"),
    # a CPU cap under what Python and torch hold: every trial died at start, recorded as the sweep's answer
    (["--grid", "precision=bf16,fp32", "--mem-limit", "1B"], "--mem-limit of 1 bytes cannot hold a CPU trial"),
    (["--search", "train.lr=uniform:0.1:0.2", "--mem-limit", "100MiB"], "give --mem-limit 1GiB or more"),
    # a sweep's own train.max_steps replaced train=1 with a mapping: both points were called the same run
    (["--grid", "train=1,2"], "--grid train=1: cannot set train.max_steps: train is 1, not a mapping"),
    (["precision=bf16", "--grid", "float8=none,rowwise"], "--grid float8=rowwise: float8=rowwise needs an NVIDIA GPU"),
])
def test_bad_input_is_one_line_exit_2_before_any_trial(assets, tmp_path, capsys, args, message):
    recipe = write_recipe(assets, tmp_path)
    out = tmp_path / "out"
    code = main(["sweep", str(recipe), *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert message in err
    assert not out.exists()


def test_without_a_recipe_the_sweep_uses_the_quickstart(tmp_path, capsys):
    """No recipe: the quickstart's defaults (as train and plan take them), then the grid's checks."""
    out = tmp_path / "out"
    code = main(["sweep", "--grid", "fsdp.shardng=full_shard,no_shard", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "quickstart defaults" in captured.out, captured
    assert "unknown config key 'fsdp.shardng'; did you mean fsdp.sharding" in captured.err and not out.exists()


def test_a_trial_is_a_job_of_its_own_under_srun_or_torchrun(monkeypatch, tmp_path):
    """A sweep started inside a job (an sbatch step, a torchrun worker) passed RANK, WORLD_SIZE or
    SLURM_PROCID/SLURM_NTASKS on to each trial, which took itself for one rank of that job and
    waited for its peers for good."""
    from shardtune.distributed.process_group import AGENT_VARS
    from shardtune.sweep import trial
    from shardtune.sweep.grid import Sweep

    for name in AGENT_VARS:
        monkeypatch.setenv(name, "3")
    seen = {}

    class Started(Exception):
        pass

    def popen(argv, env, **kwargs):
        seen.update(env)
        raise Started
    monkeypatch.setattr(trial.subprocess, "Popen", popen)
    with pytest.raises(Started):
        trial.run_trial(Sweep(None, ["data.path=x"], [("train.lr", ["1e-3"])], out=tmp_path), {}, "t", None)
    assert seen and not set(AGENT_VARS) & set(seen)


@pytest.mark.parametrize("code, stderr, status", [
    # --nproc: the kernel killed one rank (its launcher exits 1 and names it): over the memory, as a lone trial's -9
    (1, "error: rank 1 (signal SIGKILL) failed; 1 other rank(s) stopped with it; see the ranks' output above\n", "oom"),
    (-9, "", "oom"),
    (1, "RuntimeError: boom\nerror: rank 1 (exit code 1) failed; 1 other rank(s) stopped with it; see the ranks' "
        "output above\n", "failed"),
    (1, "error: rank 1 (signal SIGTERM) failed; see the ranks' output above\n", "failed"),
])
def test_a_rank_killed_by_sigkill_is_out_of_memory(monkeypatch, tmp_path, code, stderr, status):
    from shardtune.sweep import trial
    from shardtune.sweep.grid import Sweep

    class Ended:
        def __init__(self, argv, stderr, **kwargs):
            stderr.write(words)

        def wait(self, timeout=None):
            return code

    words = stderr
    monkeypatch.setattr(trial.subprocess, "Popen", Ended)
    record = trial.run_trial(Sweep(None, ["data.path=x"], [("train.lr", ["1e-3"])], out=tmp_path, nproc=2), {},
                             "t", None)
    assert record["status"] == status, record
    if status == "failed":
        assert record["note"] == "RuntimeError: boom" if "boom" in stderr else record["note"].startswith("exit code")


def test_a_trial_reads_only_its_own_metrics(monkeypatch, tmp_path):
    """A trial folder used before (an interrupted trial rerun, another study's trial-0000): the
    pruner's watch read the earlier metrics.jsonl before train replaced it, and a trial that failed
    before writing any was recorded with the earlier one's speed and validation loss."""
    from shardtune.sweep import trial
    from shardtune.sweep.grid import Sweep

    sweep = Sweep(None, ["data.path=x"], [("train.lr", ["1e-3"])], eval_steps=2, out=tmp_path)
    folder = tmp_path / "trials" / "t"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens_per_s": 9.0, "step_time_s": 1.0,
                                                      "eval_loss": 1.5, "eval_ppl": 4.5}) + "\n")

    class Failing:  # runs once past the watch, then fails before it writes anything
        def __init__(self, argv, **kwargs):
            self.polls = 0

        def wait(self, timeout=None):
            self.polls += 1
            if self.polls == 1:
                raise subprocess.TimeoutExpired("train", timeout)
            return 1

    seen = []
    monkeypatch.setattr(trial.subprocess, "Popen", Failing)
    record = trial.run_trial(sweep, {}, "t", None, watch=lambda f: seen.append(f.joinpath("metrics.jsonl").exists()))
    assert seen == [False]  # the watch saw no earlier rows
    assert record["status"] == "failed" and not {"tokens_per_s", "eval_loss"} & set(record), record


def stand_in_trials(monkeypatch) -> list:
    """Grid and search trials as stand-ins that record their point and fail (no plots to draw), the
    model checks and memory predictions (seconds each) skipped: the sweep's own logic, in this process."""
    from shardtune.sweep import grid, search

    ran = []

    def fake_trial(sweep, point, name, cap, micro_batch=None, watch=None, checkpointing=None):
        ran.append((point, micro_batch))
        return {"name": name, "point": point, "seconds": 0.1, "exit_code": 1, "status": "failed", "note": "x"}

    monkeypatch.setattr(grid, "run_trial", fake_trial)
    monkeypatch.setattr(search, "run_trial", fake_trial)
    monkeypatch.setattr(grid, "check_models", lambda *args: None)
    monkeypatch.setattr(grid, "Predictions", lambda sweep: lambda *args: None)
    monkeypatch.setattr("shardtune.sweep.search_report.draw", lambda *args: [])
    return ran


@pytest.mark.parametrize("kind", [["--grid", "train.weight_decay=0,0.1"],
                                  ["--search", "train.weight_decay=uniform:0:0.1", "--trials", "1"]])
def test_a_rerun_of_an_edited_recipe_is_refused(assets, tmp_path, monkeypatch, capsys, kind):
    """The sweep's state named the recipe by its path: rerun after an edit of the recipe (or from another
    folder holding another recipe of that name), the finished trials of the old one were kept as results
    of the new one and the table mixed the two."""
    stand_in_trials(monkeypatch)
    recipe = write_recipe(assets, tmp_path)
    out = tmp_path / "out"
    argv = ["sweep", str(recipe), *kind, "--steps", "2", "--out", str(out)]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    recipe.write_text(recipe.read_text().replace("lr: 0.001", "lr: 0.002"))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "with another config;" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("kind", [["--grid", "train.lr=0.001,0.002"],
                                  ["--search", "train.lr=choice:0.001,0.002", "--trials", "2", "--sampler", "random"]])
def test_a_point_whose_auto_layout_fits_nothing_is_a_failed_trial(assets, tmp_path, monkeypatch, kind):
    """train.micro_batch_size=auto at a point where the planner finds nothing that fits: the sweep or
    search ended there with one line (exit 2), the points after it never ran, and a rerun ended there
    again; it is that point's failed trial, saying why, and the others run."""
    from shardtune.errors import UserError
    from shardtune.plan import fit

    def resolved(cfg, world, local, host_budget=None):
        if cfg.train.lr == 0.001:
            raise UserError("train.micro_batch_size=auto: not even 1 sequence per rank fits")
        return 2, "none", "auto: micro-batch 2"

    ran = stand_in_trials(monkeypatch)
    monkeypatch.setattr(fit, "resolve_layout", resolved)
    out = tmp_path / "out"
    argv = ["sweep", str(write_recipe(assets, tmp_path)), "train.micro_batch_size=auto", *kind, "--steps", "2",
            "--out", str(out)]
    assert main(argv) == 0
    assert [(p["train.lr"], mb) for p, mb in ran] == [("0.002", 2)]
    with open(out / ("sweep.csv" if kind[0] == "--grid" else "search.csv")) as f:
        notes = {r["train.lr"]: r["note"] for r in csv.DictReader(f)}
    assert notes == {"0.001": "train.micro_batch_size=auto: not even 1 sequence per rank fits", "0.002": "x"}


def test_a_rerun_of_a_finished_auto_grid_runs_nothing(assets, tmp_path, monkeypatch):
    """train.micro_batch_size=auto under --mem-limit: a rerun planned each point again with what the
    finished trials measured (the first run had guessed from its own process), could choose another
    micro-batch, and ran the point again as a new trial beside the finished one."""
    from shardtune.plan import fit

    ran, choices = stand_in_trials(monkeypatch), iter([1, 2, 4, 4])
    monkeypatch.setattr(fit, "resolve_layout", lambda *args, **kwargs: (next(choices), "selective", "auto"))
    argv = ["sweep", str(write_recipe(assets, tmp_path)), "train.micro_batch_size=auto", "--grid",
            "train.lr=0.001,0.002", "--grid", "activation_checkpointing=auto", "--mem-limit", "2GiB", "--steps", "2",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0 and main(argv) == 0
    assert [mb for _, mb in ran] == [1, 2]
    # what each trial ran, where its point says auto
    assert [(r["micro_batch"], r["activation_checkpointing"], r["checkpointing"]) for r in rows(tmp_path / "out")] == [
        ("1", "auto", "selective"), ("2", "auto", "selective")]
