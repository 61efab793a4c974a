"""A sweep's command-line overrides against what each trial sets after them (the point's keys and
the sweep's own settings): one the trial would replace is refused before any trial, naming the key
and what sets it; one of the very value the sweep sets, or a recipe's value, is the base it runs on."""

from __future__ import annotations

import pytest

from conftest import main_in_process, tiny_overrides
from shardtune.errors import UserError
from shardtune.sweep.grid import Sweep, check, check_overrides

GRID = ["--grid", "train.seed=1,2"]
SEARCH = ["--search", "train.seed=int:1:9"]


def overrides(assets, tmp_path) -> list[str]:
    """The tiny run's overrides, less those each trial sets."""
    return [w for w in tiny_overrides(assets, tmp_path / "unused")
            if not w.startswith(("output_dir=", "train.max_steps=", "eval.max_batches="))]


@pytest.mark.parametrize("args, line", [
    (["train.max_steps=100", *GRID], "train.max_steps=100 is set per trial by --steps; drop the override"),
    (["train.seed=3", *GRID], "train.seed=3 is set per trial by --grid; drop the override or the --grid axis "
     "train.seed"),
    (["log.trackers=[tensorboard]", *GRID], "log.trackers=[tensorboard] is set per trial by the sweep (a trial "
     "keeps and publishes nothing); drop the override"),
    (["output_dir=elsewhere", *GRID], "output_dir=elsewhere is set per trial by --out"),
    (["eval.max_batches=3", *GRID], "eval.max_batches=3 is set per trial by the sweep without --eval-steps"),
    (["eval.every_steps=3", *GRID, "--eval-steps", "2"], "eval.every_steps=3 is set per trial by --eval-steps"),
    (["train.seed=3", *SEARCH], "train.seed=3 is set per trial by --search; drop the override or the --search "
     "axis train.seed"),
    (["log.every_steps=10", *SEARCH], "log.every_steps=10 is set per trial by the sweep (it measures every step"),
])
def test_an_override_a_trial_would_replace_is_refused_before_any_trial(assets, tmp_path, monkeypatch, args, line):
    from shardtune.sweep import grid, search

    def run_trial(*args, **kwargs):
        raise AssertionError("a trial started")

    for module in (grid, search):
        monkeypatch.setattr(module, "run_trial", run_trial)
    out = tmp_path / "out"
    code, err = main_in_process(["sweep", *overrides(assets, tmp_path), *args, "--out", str(out)])
    assert code == 2 and err.startswith(f"error: {line}") and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_an_override_of_the_value_the_sweep_sets_is_kept(assets, tmp_path):
    """A train command line reused for a sweep: what the trials set to the same value changes
    nothing; with --eval-steps, eval.max_batches is the user's; with --max-batch, the micro-batch
    is where the search starts, as the recipe's is."""
    same = ["log.progress=False", "log.trackers=[]", "resume=", "train.max_steps=2", "eval.max_batches=3"]
    check(Sweep(None, [*overrides(assets, tmp_path), *same], [("train.seed", ["1", "2"])], steps=2, eval_steps=2,
                out=tmp_path / "out", defaults={}))
    check(Sweep(None, overrides(assets, tmp_path), [], max_batch=True, out=tmp_path / "out", defaults={}))


def test_every_key_a_trial_sets_after_the_overrides_is_refused_as_an_override(monkeypatch, tmp_path):
    """The one list: each key=value of a real trial's command line after the user's overrides
    (the point's and the sweep's, output_dir included), given as an override of another value,
    is refused naming that key; on a GPU the CPU-only log.live_memory is the user's."""
    from shardtune.sweep import trial

    class Started(Exception):
        pass

    argv = []

    def popen(words, **kwargs):
        argv.extend(words)
        raise Started

    monkeypatch.setattr(trial.subprocess, "Popen", popen)
    for eval_steps in (None, 3):
        sweep = Sweep(None, ["data.path=x"], [("train.seed", ["1"])], eval_steps=eval_steps, out=tmp_path)
        argv.clear()
        with pytest.raises(Started):
            trial.run_trial(sweep, {"train.seed": "1"}, "t", None)
        words = [w for w in argv[argv.index("data.path=x") + 1:] if "=" in w]
        assert {"train.seed=1", "log.live_memory=2", f"output_dir={tmp_path / 'trials' / 't'}"} <= set(words)
        for word in words:
            key = word.partition("=")[0]
            sweep.overrides = [f"{key}=another"]
            with pytest.raises(UserError, match=rf"^{key}=another is set per trial by "):
                check_overrides(sweep, ["train.seed"], "--grid")
    sweep.overrides = ["model.config.n_layer=1"]  # inside a swept key: replaced with the whole
    with pytest.raises(UserError, match="n_layer=1 is set per trial by --grid; drop the override or the --grid axis "
                       "model.config$"):
        check_overrides(sweep, ["model.config"], "--grid")
    sweep.device, sweep.overrides = "cuda", ["log.live_memory=3"]
    check_overrides(sweep, ["train.seed"], "--grid")


def test_the_points_are_checked_on_the_trials_device(assets, tmp_path, monkeypatch):
    """The device is known before the points' machine checks (it was set only after them: on a GPU
    machine, float8 or QLoRA points were refused as if the trials ran on the CPU)."""
    import torch

    import shardtune.model.build as build
    from shardtune.distributed import process_group

    seen = set()
    monkeypatch.setattr(process_group, "resolve_device", lambda requested: torch.device("cuda", 0))
    monkeypatch.setattr(build, "check_machine", lambda cfg, device: seen.add(device.type))
    sweep = Sweep(None, [*overrides(assets, tmp_path), "precision=bf16"], [("float8", ["none", "rowwise"])],
                  out=tmp_path / "out", defaults={})
    check(sweep)
    assert sweep.device == "cuda" and seen == {"cuda"}
