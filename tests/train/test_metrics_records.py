"""What metrics.jsonl records around a stop and its resume: each step in one speed window, the
trackers given the file's points."""

from __future__ import annotations

import itertools
import json
import os
import signal

from conftest import tiny_overrides


def test_a_stop_and_its_resume_time_each_step_once(assets, tmp_path, monkeypatch):
    """A stop at step 3 and a save at step 5 (log.every_steps=4) wrote no record: the stopped
    attempt's steps 1-3 were in no window, and the resumed one's first (step 4 alone) and the one
    across the save were weighed by the steps since the record before. A fake clock whose marks are
    0, 1, 3, 6, ... (each gap one longer): step k (marks 2k-1, 2k) takes 2k-1 s. TensorBoard
    holds the file's points."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import shardtune.telemetry.metrics as telemetry
    import shardtune.train.trainer as train_mod
    from shardtune.config.load import load_config
    from shardtune.telemetry.report import timed_windows

    ticks = itertools.accumulate(itertools.count())
    monkeypatch.setattr(telemetry.StepClock, "mark", lambda self: float(next(ticks)))
    real, calls = train_mod.train_step, []

    def step_then_signal(*args, **kw):
        out = real(*args, **kw)
        calls.append(1)
        if len(calls) == 2:  # read with step 3 queued: the run stops at step 3
            os.kill(os.getpid(), signal.SIGUSR1)
        return out

    monkeypatch.setattr(train_mod, "train_step", step_then_signal)
    overrides = tiny_overrides(assets, tmp_path, **{"train.max_steps": 6, "log.every_steps": 4,
                                                    "checkpoint.every_steps": 5, "eval.at_start": "false",
                                                    "save_final": "false", "log.trackers": "[tensorboard]",
                                                    "eval.max_batches": 1})
    assert train_mod.run(load_config(None, overrides, defaults={}))["preempted"]
    monkeypatch.setattr(train_mod, "train_step", real)
    train_mod.run(load_config(None, [*overrides, "resume=auto"], defaults={}))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = timed_windows(rows)  # steps 1-2 are the first window, left out
    assert sum(steps for _, steps, _ in windows) == 4 and sum(seconds for *_, seconds in windows) == 5 + 7 + 9 + 11
    assert [r["step"] for r in rows if "loss" in r][-4:] == [3, 4, 5, 6]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("tokens_seen")] == \
        [(r["step"], r["tokens_seen"]) for r in rows if "tokens_seen" in r]
