"""What a fake-tensor step answers where fake tensors have no value."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from shardtune.plan.fake_step import AnswerScalars


@pytest.mark.parametrize("weights", [None, torch.float32, torch.bfloat16, torch.float64])
def test_bincount_bounded_by_minlength_has_that_length_and_torchs_dtype(weights):
    """A router counting tokens per expert (transformers 5.17's load-balancing loss) bounds the
    values by the expert count: the trace answers that many counts, in the dtype torch gives."""
    real_values = torch.tensor([0, 3, 3, 1])
    real_weights = None if weights is None else torch.ones(4, dtype=weights)
    expected = torch.bincount(real_values, weights=real_weights, minlength=6)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, AnswerScalars():
        values = mode.from_tensor(real_values)
        counted = torch.bincount(values, weights=None if real_weights is None else mode.from_tensor(real_weights),
                                 minlength=6)
    assert counted.shape == expected.shape and counted.dtype == expected.dtype


def test_bincount_without_a_bound_stays_untraceable():
    with FakeTensorMode() as mode, AnswerScalars(), pytest.raises(DynamicOutputShapeException):
        torch.bincount(mode.from_tensor(torch.tensor([0, 3])))
