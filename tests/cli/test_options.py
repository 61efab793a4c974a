"""Every option of every command takes its value through a declared type (`cli/argtypes.py`) or
a list of choices, so a value no command can use is refused while the command line is parsed."""

from __future__ import annotations

import argparse

import pytest

from shardtune.cli.main import build_parser, main


def value_options():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                yield command, action


def test_every_option_has_a_declared_type():
    untyped = [f"{command} {'/'.join(a.option_strings)}" for command, a in value_options()
               if a.choices is None and getattr(a.type, "__module__", None) != "shardtune.cli.argtypes"]
    assert list(value_options()) and untyped == []


@pytest.mark.parametrize("argv, needle", [
    (["sweep", "--search", "train.lr=uniform:0.1:0.2", "--study-name", ""], "--study-name: must not be empty"),
    (["sweep", "--search", "train.lr=uniform:0.1:0.2", "--trials", "1.5"], "--trials: '1.5' is not a whole number"),
    (["eval", "model", "--generate", "2", "--out", " "], "--out: must not be empty"),
    (["export", "ck", "out", "--push-to-hub", "user/a b"], "is not a Hub repo id"),
    # huggingface_hub refuses it only once the export is written
    (["export", "ck", "out", "--push-to-hub", "user/model.git"], "is not a Hub repo id"),
    # above the top: said as such (it said "must be at least 0")
    (["generate", "m", "--prompt", "hi", "--seed", str(2 ** 64)], "--seed: must be at most 9223372036854775807"),
    (["generate", "m", "--prompt", "hi", "--seed", "9" * 400], "got a number of 400 digits"),
    (["train", "--nproc", "2000"], "--nproc: must be at most 1024, got 2000"),
    # a size under one byte is 0 bytes once whole: a GPU of 0 bytes was planned for
    (["plan", "--gpus", "1", "--gpu-mem", "0.0000000001"], "--gpu-mem: '0.0000000001' is not a memory size"),
    (["plan", "--gpus", "1", "--gpu-mem", "16GiB", "--host-mem", "0.5b"], "--host-mem: '0.5b' is not a memory size"),
])
def test_a_value_of_the_wrong_type_is_refused_while_parsing(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def only_with_rules():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        for rule in p.get_default("only_with") or ():
            yield command, p, rule


def test_every_option_that_another_decides_is_refused_where_it_would_be_ignored():
    """Each option an `only_with` rule names, given on its own (the flag absent, or present for a
    `given=False` rule), is one line naming it: `eval --out` without `--generate` wrote no file."""
    from shardtune.cli.common import check_only_with
    from shardtune.errors import UserError

    checked = set()
    for command, p, (needed, flag, options, wanted) in only_with_rules():
        for option, dest, _ in options:
            args = argparse.Namespace(**{a.dest: a.default for a in p._actions}, only_with=[(needed, flag, options,
                                                                                             wanted)])
            setattr(args, needed, None if wanted else "1")
            setattr(args, dest, object())  # given: not its default
            with pytest.raises(UserError, match=f"^{option} (applies only with|does nothing with) {flag.split()[0]}"):
                check_only_with(args)
            setattr(args, needed, "1" if wanted else None)
            check_only_with(args)  # where it means something: no error
            checked.add(f"{command} {option}")
    assert {"eval --out", "eval --temperature", "eval --max-batches", "sweep --trials", "sweep --storage",
            "export --private"} <= checked


@pytest.mark.parametrize("argv, needle", [
    (["eval", "model", "--out", "scores.json"], "--out applies only with --generate; add --generate N"),
    (["eval", "model", "--generate", "2", "--seq-len", "64"], "--seq-len does nothing with --generate"),
    (["sweep", "--grid", "train.lr=1e-3,2e-3", "--trials", "3"], "--trials applies only with --search"),
    (["export", "ck", "out", "--private"], "--private applies only with --push-to-hub; add --push-to-hub REPO"),
])
def test_an_ignored_option_is_one_line_before_any_work(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, dests", [
    (["export", "ck", "~/model"], ["out"]),
    (["report", "~/run", "--out=~/report"], ["runs", "out"]),
    (["slurm", "r.yaml", "--nodes", "1", "--gpus-per-node", "1", "--out=~/job.sbatch", "--output-dir=~/run"],
     ["out", "output_dir"]),
    (["sweep", "--out=~/sweep"], ["out"]),
    (["eval", "m", "--data=~/d.jsonl", "--out=~/g.json"], ["data", "out"]),
    (["download", "x", "--cache-dir=~/hf"], ["cache_dir"]),
])
def test_a_path_option_reads_a_tilde_as_home(monkeypatch, tmp_path, argv, dests):
    """`--out=~/r` is one word, whose `~` the shell leaves alone: `report` wrote ./~/r and said
    'report written to ~/r/report.md' (the config's paths and the inputs read `~` as home already)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args, _ = build_parser().parse_known_args(argv)
    for dest in dests:
        value = getattr(args, dest)
        assert all(v.startswith(f"{tmp_path}/") for v in (value if isinstance(value, list) else [value])), (dest, value)


def test_a_report_to_a_tilde_path_is_written_at_home(monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    assert main(["report", "run", "--out=~/report"]) == 0
    assert (tmp_path / "home" / "report" / "report.md").is_file() and not (tmp_path / "~").exists()
