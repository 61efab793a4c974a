"""Less activation memory: checkpointing (full, selective, every n-th block) and offloading saved
activations to host memory. Applied by fsdp.apply_parallelism before sharding; neither changes a
number of the step (recomputation is deterministic; offloading moves bytes, not values)."""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref

import torch

from shardtune.errors import UserError


def save_matmuls_policy():
    """Selective checkpointing: keep the outputs of matrix multiplications and attention (the
    expensive ops: recomputing them would cost a third more FLOPs), recompute everything else
    (norms, activations, residual adds, dropout: memory-bound and cheap, yet most of the saved
    bytes of a block; float8's `_scaled_mm` is a matmul too). What the inputs of the next matmul
    need is rebuilt from a saved output."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward"]
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_checkpointing(model, blocks: list, kind: str, every: int) -> None:
    """Checkpoint the decoder blocks as `kind` says (none, full, selective, every_n), through
    transformers' per-layer checkpointing, which keeps parameter names unchanged."""
    if kind == "none":
        return
    if kind == "auto":  # a programming error: resolve.run turns auto into a mode before anything is built
        raise ValueError("activation_checkpointing=auto reached the build unresolved; resolve the run first")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"{type(model).__name__} does not support activation checkpointing; "
                        "set activation_checkpointing=none")
    kwargs = {"use_reentrant": False}
    if kind == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy())
    # Newer transformers 5.x name it activation_checkpointing_enable; 5.17 (on the GPU machines)
    # has only the deprecated name.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    if kind == "every_n":  # blocks 0, n, 2n, ... (set here: older transformers have no every_n_layers)
        for i, block in enumerate(blocks):
            if hasattr(block, "gradient_checkpointing"):
                block.gradient_checkpointing = i % every == 0


class CudaCopies:
    """The host copies of `ActivationOffload` on CUDA: on a side stream, in order, each marked by
    an event. A copy out waits for the compute that made its tensor; a copy back waits for its
    copy out, and the compute stream waits for the copy back before using it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def takes(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def to_host(self, t: torch.Tensor):
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # should t be let go early, the allocator waits for the copy
        return host, self.stream.record_event()

    def done(self, copied) -> bool:
        return copied.query()

    def wait(self, copied) -> None:
        copied.synchronize()

    def to_device(self, host: torch.Tensor, copied):
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(copied)
            back = host.to(self.device, non_blocking=True)
        return back, self.stream.record_event()

    def ready(self, back: torch.Tensor, arrived) -> torch.Tensor:
        torch.cuda.current_stream().wait_event(arrived)
        back.record_stream(torch.cuda.current_stream())  # made on the side stream, used on this one
        return back


class _Offloaded:
    """One saved activation on its way to, or in, host memory, as autograd keeps it between
    forward and backward. `kept` is the device tensor while its copy out may still run."""

    __slots__ = ("host", "copied", "kept", "nbytes", "back", "arrived", "used", "index", "order", "__weakref__")

    def __init__(self, t: torch.Tensor, host, copied, order: list):
        self.host, self.copied, self.kept, self.nbytes = host, copied, t, t.numel() * t.element_size()
        self.back, self.arrived, self.used = None, None, False
        self.index, self.order = len(order), order
        order.append(weakref.ref(self))


class ActivationOffload:
    """saved_tensors_hooks that move what autograd saves in forward to host memory (pinned) and
    bring it back for backward.

    Forward: a saved tensor stays on the device until its copy out is known done; when more than
    IN_FLIGHT_BYTES wait, the oldest copy is waited for (PCIe slower than compute throttles the
    step instead of piling up device memory: the planner counts that bound). A tensor whose copy
    is still waiting when backward asks for it is handed back as it is, with no copy back.
    Backward meets the saved tensors in about the reverse order of forward: when it asks for one,
    the copies back of the `prefetch` saved before it are started too, so they run on the side
    stream while this one's gradient is computed.

    Parameters (FSDP's gathered weights: re-gathered anyway), views of them and small tensors
    stay where they are. On CPU the host is the device: the same hooks run and move nothing.
    `copies` does the moving (CudaCopies on CUDA; `plan` passes a host account, tests a recorder)."""

    MIN_BYTES = 1 << 20  # below this a copy costs more in launch latency than it frees
    IN_FLIGHT_BYTES = 512 << 20  # device bytes whose copy out may still run: about one block's saved
    # activations of a 7B model at 4k tokens (~20 ms of PCIe 4): more only helps when PCIe lags compute
    PREFETCH = 2  # copies back started ahead of backward's need: at most this many extra on the GPU

    def __init__(self, device: torch.device, copies=None, prefetch: int = PREFETCH):
        self.copies = copies if copies is not None else (CudaCopies(device) if device.type == "cuda" else None)
        self.prefetch = prefetch
        self.order: list = []  # weak references to this forward's offloaded tensors, in pack order
        self.in_flight: collections.deque = collections.deque()  # handles still keeping their tensor
        self.in_flight_bytes = 0
        self.context = None

    def moves(self, t: torch.Tensor) -> bool:
        """Whether `t` goes to the host (on CUDA; the planner prices the same rule): not a
        parameter nor a view of one (a matmul saves `weight.t()`: copying it would move every
        layer's gathered weight over PCIe each step for nothing), and not small."""
        param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        return not param and t.numel() * t.element_size() >= self.MIN_BYTES

    def pack(self, t: torch.Tensor):
        if self.copies is None or not self.copies.takes(t) or not self.moves(t):
            return t
        handle = _Offloaded(t, *self.copies.to_host(t), self.order)
        self.in_flight.append(handle)
        self.in_flight_bytes += handle.nbytes
        while self.in_flight and (self.in_flight_bytes > self.IN_FLIGHT_BYTES
                                  or self.copies.done(self.in_flight[0].copied)):
            oldest = self.in_flight.popleft()
            if oldest.kept is not None:
                if self.in_flight_bytes > self.IN_FLIGHT_BYTES:
                    self.copies.wait(oldest.copied)
                self._let_go(oldest)
        return handle

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.kept is not None:  # its copy out may not even have finished: no copy back
            t = packed.kept
            self._let_go(packed)
            self.in_flight.remove(packed)
            packed.used = True
            return t
        self._bring_back(packed)
        for earlier in packed.order[max(packed.index - self.prefetch, 0):packed.index]:
            handle = earlier()  # None: autograd has let it go
            if handle is not None and not handle.used and handle.kept is None:
                self._bring_back(handle)
        back, packed.back, packed.used = packed.back, None, True
        return self.copies.ready(back, packed.arrived)

    def _let_go(self, handle: _Offloaded) -> None:
        handle.kept = None
        self.in_flight_bytes -= handle.nbytes

    def _bring_back(self, handle: _Offloaded) -> None:
        if handle.back is None:
            handle.back, handle.arrived = self.copies.to_device(handle.host, handle.copied)

    @contextlib.contextmanager
    def moving_with(self, copies):
        """Offload through `copies` for a while (the planner's host account on a CPU trace)."""
        kept, self.copies = self.copies, copies
        try:
            yield
        finally:
            self.copies = kept

    def install(self, model) -> None:
        """Active during each forward of `model` (the hooks travel with the saved tensors to
        backward); `installed(model)` finds it again (the planner swaps its copies)."""
        def enter(module, args):
            self.order = []
            self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.context.__enter__()

        def leave(module, args, output):
            self.context.__exit__(None, None, None)

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(leave)
        _INSTALLED[model] = self


_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def installed(model) -> ActivationOffload | None:
    """The ActivationOffload installed on `model`, if any."""
    return _INSTALLED.get(model)


def describe_memory_savers(cfg, device_type: str) -> str:
    """The start-up line's part for the non-default savers, e.g. ' | 8bit AdamW states | checkpointing selective'."""
    parts = []
    if cfg.train.optimizer_state != "fp32":
        parts.append(f"{cfg.train.optimizer_state} AdamW states")
    if cfg.fsdp.reduce_dtype != "fp32":
        parts.append(f"{cfg.fsdp.reduce_dtype} gradient reduction")
    kind = cfg.activation_checkpointing
    if kind != "none":
        parts.append(f"checkpointing {kind}" + (f" (every {cfg.activation_checkpointing_every})"
                                                 if kind == "every_n" else ""))
    if cfg.activation_offload:
        parts.append("activation offload" + ("" if device_type == "cuda" else " (CPU: hooks only, nothing moves)"))
    return "".join(f" | {p}" for p in parts)
