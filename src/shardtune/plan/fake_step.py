"""What a step under fake tensors needs to run as the GPU run would, beyond what fake tensors
give: answers for the values the step reads (scalars, counts of a known bound), DTensor's shape
propagation kept out of the count, the experts' grouped matmul in any dtype, CUDA's attention
kernels, and the fused AdamW step on the shards. Used by trace.trace_step."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode


class AnswerScalars(TorchDispatchMode):
    """A fake tensor has no value unless fake mode knows it as a constant (the optimizer's
    step count). Where the step reads an unknown one (is the gradient norm finite? did the
    scaler find an inf? how many tokens?) answer "finite", "none found", 0: the path a
    healthy step takes. A single random number (a scalar draw) is a known 0.5, so a branch on it
    is decided by its threshold: transformers 5.17's OPT draws one per layer for LayerDrop even
    at layerdrop=0 (5.23 checks the rate first), and an unknown draw would skip every layer."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.rand.default and not list(args[0]):
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            return torch.tensor(0.5, dtype=dtype, device=kwargs.get("device"))
        if func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **kwargs)
            except DataDependentOutputException:
                return True if args[0].dtype == torch.bool else 0
        if func is torch.ops.aten.bincount.default:
            try:
                return func(*args, **kwargs)
            except DynamicOutputShapeException:
                return _bincount_within(*args, **kwargs)
        return func(*args, **kwargs)


def _bincount_within(values, weights=None, minlength=0):
    """bincount's length is max(values) + 1 or `minlength`: unknown for fake values, except where
    the caller bounds the values by `minlength` (a router counting tokens per expert, as
    transformers 5.17's load-balancing loss does): the healthy answer is `minlength` counts. With
    no bound the step stays untraceable (a reason in `plan`, never a crash)."""
    if not minlength:
        raise DynamicOutputShapeException(torch.ops.aten.bincount.default)
    # torch's rule: counts are int64; weighted sums keep float32 weights, else become float64
    dtype = torch.int64 if weights is None else (torch.float32 if weights.dtype == torch.float32 else torch.float64)
    return torch.zeros(minlength, dtype=dtype, device=values.device)


_PROPAGATING = [0]  # DTensor shape propagations under way (this trace runs on one thread)


def dtensor_meta_outside_trace():
    """DTensor derives output shapes by running each op on global-shaped fake tensors in the
    active fake mode, which is ours: the tracker would count those (4x the optimizer state on 4
    ranks). A fresh fake mode for that propagation keeps it out of the count, and the tracker
    skips what the propagation makes (`propagating`): under torch 2.11 its fake arguments still
    reached the tracker and stayed alive, one fp32 copy of every parameter after backward (a 1B
    model's plan 2.3 GiB over the H200's measured peak)."""
    from unittest import mock

    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def counted(self, *args, **kwargs):
        _PROPAGATING[0] += 1
        try:
            return propagate(self, *args, **kwargs)
        finally:
            _PROPAGATING[0] -= 1

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("torch.distributed.tensor._sharding_prop.detect_fake_mode", lambda *args: None))
    stack.enter_context(mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", counted))
    return stack


def propagating() -> bool:
    """Whether DTensor is deriving an output's shape now: nothing made is the step's memory."""
    return _PROPAGATING[0] > 0


def fake_grouped_mm():
    """Mixture-of-experts models run their experts through torch's grouped matmul, whose fake
    (meta) kernel accepts only bf16 although the CPU kernel takes fp32 too: answer the other dtypes
    with an output of the meta kernel's shape. Below autograd, so the step saves for backward what
    the real op's autograd saves: a frozen expert's (LoRA, freeze.*) input is not kept. (Routing
    them to transformers' fallback op kept every input and weight, and made a gradient for each
    frozen weight: +9.5 % on a tiny Mixtral with LoRA.)"""
    return _GroupedMMAnyDtype()


class _GroupedMMAnyDtype(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and {args[0].dtype, args[1].dtype} != {torch.bfloat16}:
            return _grouped_mm_output(*args, **kwargs)
        return func(*args, **kwargs)


def _grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """An empty output of `aten._grouped_mm`'s shape (torch's meta kernel's rule): 2D x 3D and 3D x
    2D are one row of groups, 2D x 2D one matrix per group (the weight gradient), 3D x 3D a bmm."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def one_sequence_per_row():
    """A batch without position_ids gets the model's own 0..seq-1 in every row, which
    transformers' mask code reads to find packed sequences (`find_packed_sequence_indices`): a
    real run finds none, keeps no mask and takes the causal kernels (GQA's K/V heads unrepeated).
    On fake positions it cannot read the values and assumes packing: a seq x seq mask and, for
    grouped-query attention, every layer's K and V repeated to the query heads, none of which the
    run holds (+3.4 % on a tiny Llama; on CUDA, flash attention traced as memory-efficient with a
    bias). Tell it what the run finds. (No-op on a transformers without the check.)"""
    from unittest import mock

    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def cuda_attention():
    """Route scaled_dot_product_attention to the kernels CUDA picks: flash attention for fp16/bf16
    without a mask, memory-efficient attention otherwise (a boolean mask becomes an additive bias
    of the query's dtype, as on CUDA). Both keep O(seq) state per head, unlike CPU's math path."""
    from unittest import mock


    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if key.size(-3) != query.size(-3):  # grouped-query attention: one K/V head per group
            groups = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.size(-1) <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale)[0]

    return mock.patch("torch.nn.functional.scaled_dot_product_attention", sdpa)


def fused_adamw_on_shards():
    """The fused AdamW step on each parameter's local shard, as the real kernel runs it (in place,
    nothing allocated). torch 2.11's DTensor dispatch of `_fused_adamw_` on fake tensors (the GPU
    machine's version) holds five copies of the optimizer state at once, a peak no real step has
    (measured: 2.11 predicted +37 % on 2 ranks of GPT-2 small, 2.13 exact)."""
    from unittest import mock

    from torch.distributed.tensor import DTensor

    original = torch._fused_adamw_

    def on_shards(*tensor_lists, **kwargs):
        return original(*[[t.to_local() if isinstance(t, DTensor) else t for t in ts] for ts in tensor_lists],
                        **kwargs)

    return mock.patch.object(torch, "_fused_adamw_", on_shards)  # torch.optim looks it up at each step


def cpu_cast_copies(func, args, kwargs) -> list[torch.Tensor]:
    """The temporaries a CPU kernel makes for `func(*args, **kwargs)` beside its output: CPU's
    TensorIterator casts each operand of a pointwise op that is not in the op's common dtype to it
    (`.to(common)`, a copy held while the op runs; an in-place op also computes into a temporary of
    that dtype), where CUDA casts inside the kernel. Fake tensors run no kernel, so the trace saw
    none: a bf16 step's fp32 routing weights times a mixture of experts' bf16 outputs (tokens x
    top-k x hidden in fp32 more, -4.7 % on a tiny Mixtral with checkpointing). Made empty, on the
    operands' (fake) device."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    if torch.Tag.pointwise not in func.tags:
        return []
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    if len({t.dtype for t in tensors}) < 2:
        return []
    _, common = elementwise_dtypes(*tensors, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    copies = [t for t in tensors if t.dtype != common]
    if func._schema.is_mutable and tensors and tensors[0] is args[0] and args[0].dtype != common:
        copies.append(args[0])  # the in-place result, computed in the common dtype and copied back
    return [torch.empty_like(t, dtype=common) for t in copies]


# What a collective allocates inside the process-group backend beside its own input and output,
# by backend: {c10d op name: index of the argument whose size it copies}. gloo (CPU runs)
# reduce-scatters through an all-reduce of a clone of the input, then copies this rank's slice
# out, and all-gathers into a temporary of the output's size before copying it in (measured on
# torch 2.13: the profiler shows the clone / empty inside `_reduce_scatter_base_` /
# `_allgather_base_`, and the process's high-water mark grows by that size). NCCL (CUDA runs)
# works in the tensors it is given. A trace runs on torch's "fake" backend, which copies nothing.
BACKEND_COPIES = {"gloo": {"c10d::_reduce_scatter_base_": 1, "c10d::_allgather_base_": 0}, "nccl": {}}


def backend_of(target: str) -> str:
    """The process-group backend a run on `target` ("cpu" or "cuda") uses for its collectives
    (distributed.process_group: gloo on CPU, NCCL on CUDA)."""
    return "nccl" if target == "cuda" else "gloo"
