"""Fused kernels from Liger-Kernel (`kernels=liger`, the `liger` extra): its RMSNorm, rotary
embedding and SwiGLU for the model's HF family, patched into the model before adapters and
sharding, and its fused linear cross-entropy as the head loss in place of our chunked one
(model/loss.py calls `head_loss` here: one loss path per job).

Liger's kernels are Triton kernels: CUDA (or ROCm) only, with no CPU path (on CPU Triton stops with
"0 active drivers"), so a run off the GPU is refused. Liger's own causal-LM forward, which reads the
head's weight outside the head's forward, is not used: FSDP2 gathers a unit's weight only when its
forward runs, so the fused loss runs inside the head's forward, as the chunked loss does."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from shardtune import hf_patches
from shardtune.errors import UserError
from shardtune.hardware import LIGER_NEEDS_CUDA

KERNELS = ("none", "liger")


def liger_families() -> frozenset[str]:
    """The model types the installed Liger-Kernel patches (its MODEL_TYPE_TO_APPLY_LIGER_FN)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def check(kernels: str, device, model_type: str | None = None) -> None:
    """The machine's and the model's part of `kernels=liger`: a CUDA device, Liger-Kernel
    installed, and a model family it has kernels for (where `model_type` is given)."""
    if kernels == "none":
        return
    if getattr(device, "type", device) != "cuda":
        raise UserError(LIGER_NEEDS_CUDA)
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("kernels=liger needs Liger-Kernel, which is not installed: pip install 'shardtune[liger]' "
                        "(or set kernels=none)")
    if model_type is not None and model_type not in liger_families():
        version = importlib.metadata.version("liger-kernel")
        raise UserError(f"kernels=liger: Liger-Kernel {version} has no kernels for model_type {model_type!r}; set "
                        "kernels=none")


def apply(model, kernels: str) -> bool:
    """Patch Liger's RMSNorm, rotary embedding and SwiGLU (whatever its function for this family
    takes) into `model` (the plain HF model, on meta or not: only forwards are swapped, names and
    parameters stay). Its fused cross-entropy is left to `head_loss`. True where applied."""
    if kernels != "liger":
        return False
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    # Liger also swaps the family module's rotary function and norm/MLP classes: process-wide, so any
    # model of this family built later in the process has them too (a rank trains one model); recorded,
    # so that a fresh model counted on meta tensors is built with transformers' own (hf_patches.py)
    hf_patches.recorded(lambda: _apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False))
    model.__dict__["_shardtune_kernels"] = kernels
    return True


def head_loss(flat, weight, labels, accuracy: bool, ignore_index: int):
    """Liger's fused linear cross-entropy of `flat` (N x d) through the head `weight` against
    `labels` (N): the summed loss, or with `accuracy` [loss, number correct]. Gradients are
    accumulated in fp32, as the chunked loss does."""
    import torch
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if torch.is_grad_enabled() and weight.requires_grad and not flat.requires_grad:
        flat = flat.detach().requires_grad_()  # Liger computes the weight's gradient only beside the input's
    out = liger_fused_linear_cross_entropy(flat, weight, labels, ignore_index=ignore_index, reduction="sum",
                                           accum_dtype=torch.float32, return_token_accuracy=accuracy)
    if not accuracy:
        return out.float()
    valid = (labels != ignore_index).sum()
    return torch.stack([out.loss.float(), (out.token_accuracy * valid).round()])


def describe(model, head_fused: bool) -> str:
    """The start-up line's part, e.g. ' | Liger kernels: 33 modules (LigerRMSNorm, LigerSwiGLUMLP),
    rotary, fused linear cross-entropy'."""
    if not any("_shardtune_kernels" in m.__dict__ for m in model.modules()):
        return ""
    names = [m._get_name() for m in model.modules() if m._get_name().startswith("Liger")]
    return (f" | Liger kernels: {len(names)} modules ({', '.join(sorted(set(names)))}), rotary"
            + (", fused linear cross-entropy" if head_fused else " (head loss: full logits, the family's head is "
               "not plain)"))
