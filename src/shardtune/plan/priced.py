"""What a fake-tensor trace on CPU cannot run as the GPU run would, priced as that run holds it:

- low-precision optimizer state: torchao's step is torch.compile'd per parameter and cannot run
  on fake tensors, so the step is traced with fp32 moments, and each precision's state is
  counted per parameter shard from torchao's own buffers (`_new_buffer`, made on the meta
  device: codes, block scales, lookup table, and the fp32 fallback for small tensors);
- activation offloading: on CUDA the saved activations go to host memory in forward and come
  back in backward; a CPU trace moves nothing, so the real hooks run with copies into a host
  account of the tracker (the device copy is released past the in-flight bound, a fresh one
  allocated when backward brings it back).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn

# Bytes per value of the parameter being updated that an optimizer step holds beside its state,
# by state precision: torchao's compiled 8-bit step updates one parameter at a time with both
# moments dequantized to fp32 (8.03 bytes per value measured with torch profiler's allocator
# totals on torch 2.13 / CPU; the gradient is fp32 already, counted as such); its 4-bit step runs
# the same code over the 4-bit subclass (CUDA only, not measured here). torchao's bf16 step
# (fused: nothing measured) and torch's fused fp32 AdamW update in place.
STEP_TRANSIENT = {"8bit": 8, "4bit": 8}


def state_bytes(model) -> dict[str, int]:
    """{"state_<precision>": bytes of AdamW's moments on this rank} for each precision this
    install can run: its trainable parameters' local shards, each as the optimizer keeps it;
    and "largest_shard": the values of the largest (what STEP_TRANSIENT is counted on)."""
    shards = [p.to_local().numel() if hasattr(p, "to_local") else p.numel()
              for p in model.parameters() if p.requires_grad]
    return {"largest_shard": max(shards, default=0),
            **{f"state_{precision}": sum(_per_shard(precision, n) for n in shards) for precision in available_states()}}


def step_transient(precision: str, largest_shard: int) -> int:
    """Bytes the optimizer step of `precision` holds beside the state, at its peak (STEP_TRANSIENT)."""
    return STEP_TRANSIENT.get(precision, 0) * largest_shard


@functools.cache
def available_states() -> tuple[str, ...]:
    """The optimizer state precisions the planner can price (and train can run): bf16/8bit/4bit
    need torchao (the `lowbit` extra)."""
    try:
        import torchao.optim  # noqa: F401  (its import warnings are quieted in shardtune/__init__.py)
    except ImportError:
        return ("fp32",)
    return ("fp32", "bf16", "8bit", "4bit")


@functools.cache
def _per_shard(precision: str, numel: int) -> int:
    """Bytes of both moments (and the step count) of one parameter shard of `numel` values."""
    if precision == "fp32":  # torch's AdamW: two fp32 moments and a scalar step tensor
        return 8 * numel + 4
    from shardtune.config.schema import TrainConfig
    from shardtune.train.optim import build_optimizer, optimizer_state_bytes

    holder = nn.Linear(1, 1, bias=False, device="meta")
    optimizer = build_optimizer(holder, TrainConfig(optimizer_state=precision), torch.device("cpu"))
    shard = torch.empty(numel, device="meta")
    with _meta_qmaps():
        optimizer.state[holder.weight] = {"step": torch.tensor(0.0, device="meta"),
                                          "exp_avg": optimizer._new_buffer(shard, True),
                                          "exp_avg_sq": optimizer._new_buffer(shard, False)}
    return optimizer_state_bytes(optimizer)


@contextlib.contextmanager
def _meta_qmaps():
    """torchao builds its quantization lookup tables from real numbers: make them (cached) first."""
    from torchao.optim import subclass_4bit, subclass_8bit

    for module in (subclass_8bit, subclass_4bit):
        module.get_qmap_signed(), module.get_qmap_unsigned()
    yield


class _OnHost:
    """A saved activation moved to host memory: what backward needs to bring it back."""
    __slots__ = ("shape", "stride", "dtype", "nbytes", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype = t.shape, t.stride(), t.dtype
        self.nbytes = t.numel() * t.element_size()  # what a copy to the host moves


class _HostAccount:
    """ActivationOffload's copies on a CPU trace, as on CUDA: what it moves (its own rule,
    `ActivationOffload.moves`, its in-flight bound and its prefetching) goes to `tracker`'s host
    account (`host_bytes`, `host_peak`, while autograd keeps the handle); a copy back allocates the
    device tensor again. A trace has no clock: no copy out is known done before the bound forces a
    wait (the most device memory the bound lets a real run keep)."""

    def __init__(self, tracker):
        self.tracker = tracker

    def takes(self, t) -> bool:
        return True

    def to_host(self, t):
        handle = _OnHost(t)
        self.tracker.host_bytes += handle.nbytes
        self.tracker.host_peak = max(self.tracker.host_peak, self.tracker.host_bytes)
        weakref.finalize(handle, self._release, handle.nbytes)  # pinned memory lives as long as its handle
        return handle, None

    def _release(self, nbytes: int) -> None:
        self.tracker.host_bytes -= nbytes

    def done(self, copied) -> bool:
        return False

    def wait(self, copied) -> None:
        pass

    def to_device(self, handle, copied):
        return torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype), None

    def ready(self, back, arrived):
        return back


@contextlib.contextmanager
def offloaded_activations(tracker, model):
    """Run the ActivationOffload installed on `model` as on CUDA, its copies into `tracker`'s
    host account. Hooks nest: activation checkpointing's own hooks win inside checkpointed
    blocks, as in the real run."""
    from shardtune.distributed.activation_memory import installed

    with installed(model).moving_with(_HostAccount(tracker)):
        yield
