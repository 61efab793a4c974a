"""AdamW with the usual decay groups, and the learning rate as a function of the step."""

from __future__ import annotations

import math

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from shardtune.config.schema import TrainConfig


def build_optimizer(model, cfg: TrainConfig, device, precision: str = "fp32"):
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Biases and norm weights are the 1-D parameters; decaying them only hurts.
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # Fused kernels exist for CUDA and CPU (and take DTensor shards); the sharded fp16 grad
    # scaler hands them a found-inf tensor they do not accept, so fp16 uses foreach.
    fused = device.type in ("cuda", "cpu") and precision != "fp16"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused,
                             foreach=None if fused else True)


def build_grad_scaler(precision: str, device):
    """fp16 needs a (sharded) gradient scaler; bf16 and fp32 none."""
    if precision != "fp16":
        return None

    return ShardedGradScaler(device=device.type)


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): a pure function of the step, so a
    resumed run needs no scheduler state."""
    return cfg.lr * lr_factor(step, total, cfg)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
