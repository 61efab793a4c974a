"""How many optimizer steps a run trains (train.optim.total_steps) against exact decimal arithmetic:
train.epochs as written, times the steps of an epoch, rounded down."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.config.schema import TrainConfig
from shardtune.errors import UserError
from shardtune.train.optim import total_steps


@settings(max_examples=300, deadline=None)
@given(digits=st.integers(1, 10**7), decimals=st.integers(0, 4), per=st.integers(1, 10**4), whole=st.booleans())
def test_epochs_are_the_steps_of_the_decimal_written(digits, decimals, per, whole):
    """0.29 epochs of 100 steps are 29 steps (in floats 28.999..., which made 28). `whole`: epochs
    times the steps of an epoch is a whole number, where a float's error below it counted."""
    written = Decimal(digits).scaleb(-decimals)
    steps_per_epoch = per * 10**decimals if whole else per
    got = total_steps(TrainConfig(epochs=float(written)), steps_per_epoch)
    assert got == max(1, int(written * steps_per_epoch)), str(written)


def test_the_known_float_cases_and_the_bounds():
    assert total_steps(TrainConfig(epochs=0.29), 100) == 29
    assert total_steps(TrainConfig(epochs=0.58), 50) == 29
    assert total_steps(TrainConfig(epochs=0.001), 100) == 1  # at least one
    assert total_steps(TrainConfig(epochs=1.5, max_steps=7), 100) == 7  # max_steps wins
    with pytest.raises(UserError, match=r"train.epochs=1e\+300 is 1e\+303 optimizer steps .* set train.max_steps"):
        total_steps(TrainConfig(epochs=1e300), 1000)
