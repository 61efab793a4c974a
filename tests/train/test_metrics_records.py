"""What metrics.jsonl records around a stop and its resume: each step in one speed window, the
trackers given the file's points."""

from __future__ import annotations

import itertools
import json
import os
import signal

import pytest

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


def test_a_skipped_step_a_run_resumes_from_ends_its_speed_window(assets, tmp_path, monkeypatch):
    """A non-finite step (on_nan=skip) at a checkpoint was recorded without its speed: after a crash
    and a resume from that checkpoint the resumed first window (step 3 alone, 6 s) was weighed as the
    2 steps since step 1's record (12 s for 9). Fake clock as above: attempt 1 times steps 1-2 as 1 and
    3 s and dies in step 3; the resume times step 3 as 6 s, step 4 as 8 s."""
    import shardtune.telemetry.metrics as telemetry
    import shardtune.train.trainer as train_mod
    from shardtune.config.load import load_config
    from shardtune.telemetry.report import read_metrics, timed_windows

    ticks = itertools.accumulate(itertools.count())
    monkeypatch.setattr(telemetry.StepClock, "mark", lambda self: float(next(ticks)))
    real, calls = train_mod.train_step, []

    def nan_then_crash(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the node died")
        out = real(*args, **kw)
        if len(calls) == 2:
            out.loss_sum = out.loss_sum * float("nan")
        return out

    monkeypatch.setattr(train_mod, "train_step", nan_then_crash)
    overrides = tiny_overrides(assets, tmp_path, **{"train.max_steps": 4, "log.every_steps": 1, "on_nan": "skip",
                                                    "checkpoint.every_steps": 2, "eval.at_start": "false",
                                                    "save_final": "false", "eval.every_steps": 0})
    with pytest.raises(RuntimeError, match="the node died"):
        train_mod.run(load_config(None, overrides, defaults={}))
    monkeypatch.setattr(train_mod, "train_step", real)
    train_mod.run(load_config(None, [*overrides, "resume=auto"], defaults={}))
    rows = read_metrics(tmp_path)
    assert [(r["step"], r.get("skipped")) for r in rows] == [(1, None), (2, True), (3, None), (4, None)]
    assert [(steps, seconds) for _, steps, seconds in timed_windows(rows, skip=0)] == [(1, 1), (1, 3), (1, 6), (1, 8)]
    assert rows[1]["loss"] is None and rows[1]["lr"] > 0 and rows[1]["tokens_seen"] > rows[0]["tokens_seen"]
