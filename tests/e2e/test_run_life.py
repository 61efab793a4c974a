"""A run's life over time, with test_errors.py's harness: how long it trains, where its outputs
and those of the commands about it may go, what its trackers and uploads are given. Each bad
input is one `error: ...` line naming the problem and the fix, exit code 2, nothing already
written destroyed."""

from __future__ import annotations

import pytest
from test_errors import _isolated, datasets_cache, fails, out, qs_assets, recipe, snapshot  # noqa: F401


@pytest.mark.parametrize("epochs", ["1e308", "1e30"], ids=["overflows", "past-the-counter"])
def test_more_epochs_than_a_step_counter_holds(capfd, recipe, out, epochs):
    """train.epochs is a float: times the data's steps per epoch it overflowed to infinity (an
    OverflowError traceback) or passed 2**63-1 steps."""
    before = snapshot(out)
    fails(capfd, ["train", recipe, f"output_dir={out}", "train.max_steps=0", f"train.epochs={epochs}"],
          f"train.epochs={float(epochs):g}", "per epoch", "2**63-1", "train.max_steps")
    assert snapshot(out) == before
