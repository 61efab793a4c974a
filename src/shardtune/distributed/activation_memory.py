"""Less activation memory: checkpointing (full, selective, every n-th block) and offloading saved
activations to host memory. Applied by fsdp.apply_parallelism before sharding; neither changes a
number of the step (recomputation is deterministic; offloading moves bytes, not values)."""

from __future__ import annotations

import functools

import torch

from shardtune.errors import UserError


def save_matmuls_policy():
    """Selective checkpointing: keep the outputs of matrix multiplications and attention (the
    expensive ops: recomputing them would cost a third more FLOPs), recompute everything else
    (norms, activations, residual adds, dropout: memory-bound and cheap, yet most of the saved
    bytes of a block). What the inputs of the next matmul need is rebuilt from a saved output."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
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


class ActivationOffload:
    """saved_tensors_hooks that move what autograd saves in forward to pinned host memory and bring
    it back when backward needs it. On CUDA the copies run on a side stream: the device-to-host
    copy overlaps the rest of forward (the device tensor is kept alive by `record_stream` until
    its copy is done), the copy back is ordered before its use by an event. Parameters (FSDP's
    gathered weights: re-gathered anyway), views of them and small tensors stay where they are. On CPU the host
    is the device: the same hooks run, and the "move" keeps the tensor (no copy, no saving)."""

    MIN_BYTES = 1 << 20  # below this a copy costs more in launch latency than it frees

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.context = None

    def moves(self, t: torch.Tensor) -> bool:
        """Whether `t` goes to the host (on CUDA; the planner prices the same rule): not a
        parameter nor a view of one (a matmul saves `weight.t()`: copying it would move every
        layer's gathered weight over PCIe each step for nothing), and not small."""
        param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        return not param and t.numel() * t.element_size() >= self.MIN_BYTES

    def pack(self, t: torch.Tensor):
        if not self.moves(t) or not self.cuda or t.device.type != "cuda":
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # the allocator keeps t until the copy has read it
        return (t.device, host, self.stream.record_event())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(copied)
            back = host.to(device, non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)
        back.record_stream(torch.cuda.current_stream())
        return back

    def install(self, model) -> None:
        """Active during each forward of `model` (the hooks travel with the saved tensors to backward)."""
        def enter(module, args):
            self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.context.__enter__()

        def leave(module, args, output):
            self.context.__exit__(None, None, None)

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(leave)


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
