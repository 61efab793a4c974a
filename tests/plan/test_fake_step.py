"""What a fake-tensor step answers where fake tensors have no value."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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


def test_the_fused_optimizer_step_holds_the_state_once():
    """A real fused AdamW step updates the shards in place: in the trace the optimizer state at the
    step's peak is the steady state, nothing more (torch 2.11's DTensor dispatch under fake tensors
    held five copies; `fake_step.fused_adamw_on_shards` runs it on the shards)."""
    import json

    from conftest import TINY
    from shardtune.config.load import load_config
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.trace import trace_step

    cfg = load_config(None, [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "data.seq_len=64",
                             "train.micro_batch_size=2", "train.global_batch_size=4", "device=cpu"])
    trace = trace_step(cfg, load_hf_config(cfg.model), world_size=2)
    during = max(p.get("optimizer_state", 0) for key, p in trace.phases.items() if key[1] == "optimizer")
    assert during == trace.steady["optimizer_state"] > 0


def test_what_dtensor_shape_propagation_allocates_is_not_the_steps_memory():
    """DTensor derives an output's shape by running the op on fake tensors; under torch 2.11 those
    reached the tracker and stayed alive: one fp32 copy of every parameter after backward, a 1B
    model's plan 2.3 GiB over the H200's measured peak. Here every norm layer's forward runs a
    shape propagation that allocates (and keeps) 4 MiB: the traced peak must not move."""
    import json

    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from transformers.models.llama import modeling_llama

    from conftest import TINY
    from shardtune.config.load import load_config
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.fake_step import propagating
    from shardtune.plan.trace import trace_step

    cfg = load_config(None, [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "data.seq_len=64",
                             "train.micro_batch_size=2", "train.global_batch_size=4", "device=cpu"])
    hf_config = load_hf_config(cfg.model)
    plain = trace_step(cfg, hf_config, world_size=1)
    kept, seen, norm = [], [], modeling_llama.LlamaRMSNorm.forward

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def allocating(self, op_schema):
        seen.append(propagating())
        kept.append(torch.empty(1 << 20))  # alive to the end, as 2.11's fake arguments were
        return None if op_schema is None else propagate(self, op_schema)  # DTensor's own ops: their shapes

    def norm_propagating_first(self, hidden):
        ShardingPropagator._propagate_tensor_meta_non_cached(None, None)
        return norm(self, hidden)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", allocating)
        mp.setattr(modeling_llama.LlamaRMSNorm, "forward", norm_propagating_first)
        traced = trace_step(cfg, hf_config, world_size=1)
    assert any(seen) and not propagating()  # some ran inside the traced step (others at the build, untracked)
    assert traced.peak_bytes() == plain.peak_bytes()


FLOATS = (torch.float32, torch.bfloat16, torch.float16)
POINTWISE = {"mul": (torch.ops.aten.mul.Tensor, torch.mul), "add": (torch.ops.aten.add.Tensor, torch.add),
             "maximum": (torch.ops.aten.maximum.default, torch.maximum),
             "mul_": (torch.ops.aten.mul_.Tensor, torch.Tensor.mul_)}


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(sorted(POINTWISE)), dtypes=st.permutations(FLOATS).map(lambda d: d[:2]),
       shapes=st.sampled_from([((16, 8), (16, 8)), ((16, 8), (16, 1)), ((16, 1), (16, 8)), ((16, 8), ()),
                               ((), (16, 8))]))
def test_the_casts_a_cpu_kernel_makes_are_the_ones_the_trace_counts(op, dtypes, shapes):
    """A pointwise op of mixed dtypes on CPU copies each operand not of the common dtype (and an
    in-place result) into a temporary of it, held while the op runs; fake tensors run no kernel. The
    trace counts exactly the allocator's bytes (cpu_cast_copies: the output's bytes aside)."""
    from shardtune.plan.fake_step import cpu_cast_copies
    from shardtune.plan.measure import allocator_peak

    func, call = POINTWISE[op]
    in_place = op.endswith("_")
    if in_place and torch.broadcast_shapes(*shapes) != shapes[0]:
        return  # an in-place result keeps its own shape
    a, b = (torch.ones(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True))
    target = a.clone() if in_place else a
    outputs = []
    allocated = allocator_peak(lambda: outputs.append(call(target, b)), 0)
    with FakeTensorMode() as mode:
        casts = cpu_cast_copies(func, (mode.from_tensor(a), mode.from_tensor(b)), {})
    assert sum(c.nbytes for c in casts) + (0 if in_place else outputs[0].nbytes) == allocated
