"""shardtune's learning-rate schedule against transformers' (`train/optim.lr_factor` keeps its own
lines: calling transformers' takes a stand-in optimizer and two schedules). transformers' warmup
trains its first step at lr 0, shardtune's at lr/warmup, so no one transformers schedule is it.
Read one step ahead during warmup (constant-with-warmup) and from its warmup-stable-decay
schedule after (no stable phase, `min_lr_ratio` as the floor), transformers gives the same factor
at every step, exactly; the plain cosine-with-min-lr schedule differs in the warmup."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_wsd_schedule,
)

from shardtune.config.schema import TrainConfig
from shardtune.train.optim import lr_at, lr_factor


def lambda_of(make, **kw):
    """transformers' schedule as a function of the step (its LambdaLR's own lambda)."""
    return make(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), **kw).lr_lambdas[0]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup, total, floor", [(10, 100, 0.1), (0, 37, 0.0), (5, 6, 0.25), (1, 50, 0.0)])
def test_schedule_is_transformers_read_one_step_ahead_in_warmup(schedule, warmup, total, floor):
    cfg = TrainConfig(lr=1.0, warmup_steps=warmup, lr_schedule=schedule, min_lr_ratio=floor)
    ramp = lambda_of(get_constant_schedule_with_warmup, num_warmup_steps=warmup)
    decay = (lambda s: 1.0) if schedule == "constant" else lambda_of(
        get_wsd_schedule, num_warmup_steps=warmup, num_decay_steps=total - warmup, num_stable_steps=0,
        decay_type=schedule, min_lr_ratio=floor)
    ours = [lr_factor(s, total, cfg) for s in range(total + 1)]
    theirs = [ramp(s + 1) if s < warmup else decay(s) for s in range(total + 1)]
    assert ours == theirs  # exactly, float for float
    if warmup:
        assert ours[0] == 1 / warmup and ramp(0) == 0.0  # the one difference: transformers' first step


def test_transformers_cosine_with_min_lr_differs_in_warmup_only():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    theirs = lambda_of(get_cosine_with_min_lr_schedule_with_warmup, num_warmup_steps=10, num_training_steps=100,
                       min_lr_rate=0.1)
    differ = [s for s in range(101) if lr_factor(s, 100, cfg) != pytest.approx(theirs(s), abs=1e-12)]
    assert differ == list(range(10))


def test_a_resume_on_another_schedule_says_so():
    """max_steps raised from 10 to 14 on resume at step 6: step 7's cosine lr jumped from 5.5e-4 to
    7.75e-4 without a word; the same schedule says nothing, nor a change that leaves step 7's lr."""
    from shardtune.train.optim import schedule_change

    saved = {"lr": 1e-3, "warmup_steps": 2, "max_steps": 10, "min_lr_ratio": 0.1, "added_later": 1}
    now = TrainConfig(lr=1e-3, warmup_steps=2, max_steps=14)
    line = schedule_change(saved, now, 6, 4)
    assert line == ("learning rate: step 7 trains at 0.000775, where the checkpoint's run was at 0.00055: the "
                    "schedule is this run's (cosine over 14 steps, the checkpoint's run 10), taken up at step 6")
    assert schedule_change(saved, TrainConfig(lr=1e-3, warmup_steps=2, max_steps=10), 6, 4) is None
    assert schedule_change({**saved, "max_steps": 0, "epochs": 2.5}, TrainConfig(lr=1e-3, warmup_steps=2,
                                                                                 max_steps=10), 6, 4) is None
    assert "(constant over 10 steps)" in schedule_change(saved, TrainConfig(lr=1e-3, warmup_steps=2, max_steps=10,
                                                                            lr_schedule="constant"), 6, 4)


@settings(max_examples=300, deadline=None)
@given(warmup=st.integers(0, 60), total=st.integers(1, 120), schedule=st.sampled_from(["cosine", "linear", "constant"]),
       floor=st.sampled_from([0.0, 0.1, 0.5, 1.0]), lr=st.floats(1e-6, 1.0))
def test_every_step_of_every_schedule_is_transformers_get_scheduler(warmup, total, schedule, floor, lr):
    """Any warmup (longer than the run too), run length and floor: the lr of each step a run trains
    (0 .. total-1) is transformers' `get_scheduler` one step ahead in warmup, at the step after it;
    the warmup ends at the peak and no step trains at 0 or above the peak."""
    cfg = TrainConfig(lr=lr, warmup_steps=warmup, lr_schedule=schedule, min_lr_ratio=floor)
    ramp = lambda_of(get_constant_schedule_with_warmup, num_warmup_steps=warmup)
    decay = {"constant": lambda s: 1.0,
             "cosine": lambda_of(get_cosine_with_min_lr_schedule_with_warmup, num_warmup_steps=warmup,
                                 num_training_steps=total, min_lr_rate=floor),
             "linear": lambda_of(get_wsd_schedule, num_warmup_steps=warmup, num_decay_steps=max(0, total - warmup),
                                 num_stable_steps=0, decay_type="linear", min_lr_ratio=floor)}[schedule]
    ours = [lr_at(s, total, cfg) for s in range(total)]
    theirs = [lr * (ramp(s + 1) if s < warmup else decay(s)) for s in range(total)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)
    assert all(0 < x <= lr for x in ours)
    if warmup and warmup <= total:
        assert ours[warmup - 1] == lr
