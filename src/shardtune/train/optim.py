"""AdamW with the usual decay groups and the configured moment precision, and the learning
rate as a function of the step.

Low-precision moments (train.optimizer_state) come from torchao's optimizers: 8bit/4bit are its
block-quantized AdamW8bit/AdamW4bit, bf16 its same fused step over plain bf16 moments. They take
FSDP2's DTensor shards (the state is a DTensor around torchao's tensor subclass) and save and load
through DCP like fp32 moments. Their step is torch.compile'd per parameter shape (a C++ compiler
on CPU); tensors under 4096 values keep fp32 moments, as bitsandbytes does.

That compiled step runs with torch's AOTAutograd cache off: the cache is on disk, shared by the
ranks of a host, and does not tell a DTensor's local shards apart, so where the ranks' shards differ
(GPT-2's vocabulary of 50257 rows on 2 ranks: 25129 and 25128) one rank loaded the step compiled for
another's shard ("expected size 25129==25128"). Inductor's own cache (keyed by the local shapes,
and the expensive part: the C++ compile) still serves every rank."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from shardtune.config.schema import TrainConfig, known_fields
from shardtune.config.validation import INT_LIMIT
from shardtune.errors import UserError


def build_optimizer(model, cfg: TrainConfig, device, precision: str = "fp32", lora_plus_ratio: float = 0.0):
    """AdamW over the trainable parameters, moments in cfg.optimizer_state precision. With
    `lora_plus_ratio` (LoRA+), the B matrices learn at that multiple of the learning rate."""
    by_group: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_group.setdefault((not decays(name, p), _lr_scale(name, p, lora_plus_ratio)), []).append(p)
    # the decayed group first (the order checkpoints were saved in), then by learning rate
    groups = [{"params": params, "weight_decay": 0.0 if flat else cfg.weight_decay, "lr": cfg.lr * scale,
               "lr_scale": scale} for (flat, scale), params in sorted(by_group.items())]
    if cfg.optimizer_state != "fp32":
        return _low_precision_adamw(groups, cfg)
    # Fused kernels exist for CUDA and CPU (and take DTensor shards); the sharded fp16 grad
    # scaler hands them a found-inf tensor they do not accept, so fp16 uses foreach.
    fused = device.type in ("cuda", "cpu") and precision != "fp16"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused,
                             foreach=None if fused else True)


def decays(name: str, p) -> bool:
    """train.weight_decay's rule, the same for every method: matrices decay (weights, embeddings,
    LoRA's A and B, prompt and prefix tokens); biases, norm weights and scaling vectors do not,
    decay pulling them to 0 only hurts. Those are the 1-D parameters (DoRA's magnitudes, the
    adaption prompt's gate, gpt-oss's attention sinks among them), whatever is named a bias
    (gpt-oss's experts keep theirs as experts x width) and IA3's scales, which peft stores as
    (n, 1) or (1, n) matrices. Hugging Face Trainer goes by names only and decays the vectors."""
    return p.ndim >= 2 and "bias" not in name.rsplit(".", 1)[-1] and IA3_SCALES not in name.split(".")


IA3_SCALES = "ia3_l"  # peft's IA3Layer.adapter_layer_names: the module holding each adapter's scales


def _lr_scale(name: str, p, lora_plus_ratio: float) -> float:
    """LoRA+ (Hayou et al. 2024): LoRA's B matrices and the 1-D adapter parameters (DoRA's
    magnitudes) at `lora_plus_ratio` x lr, the rest at lr, as peft's `create_loraplus_optimizer`;
    an adapted embedding's B too (the paper's rule), where peft puts its A and B at a fixed 1e-6."""
    if lora_plus_ratio and ("lora_B" in name or "lora_embedding_B" in name or p.ndim == 1):
        return lora_plus_ratio
    return 1.0


def _low_precision_adamw(groups: list[dict], cfg: TrainConfig):
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
        from torchao.optim.adam import _AdamBase
    except ImportError:
        raise UserError(f"train.optimizer_state={cfg.optimizer_state} needs torchao; pip install "
                        "'shardtune[lowbit]' (or keep train.optimizer_state=fp32)") from None

    class AdamWBf16States(_AdamBase):
        """torchao's AdamW step (fp32 math) with bf16 moments: block_size 1 puts every tensor of
        at least 4096 values into `_subclass_zeros`, here a plain bf16 tensor (round to nearest)."""

        def __init__(self, params, lr, betas, eps, weight_decay):
            super().__init__(params, lr, betas, eps, weight_decay, False, block_size=1,
                             bf16_stochastic_round=False, is_adamw=True)
            # torch's load_state_dict casts every floating state to its parameter's dtype: a resumed
            # run went on with fp32 moments (twice the memory, other roundings from its second step)
            self.register_load_state_dict_post_hook(AdamWBf16States._moments_to_bf16)

        @staticmethod
        def _subclass_zeros(p, signed, block_size):
            return torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)

        @staticmethod
        def _moments_to_bf16(optimizer) -> None:
            """The moments `_new_buffer` makes bf16 (those of this rank's shards of 4096 values or more), bf16."""
            for p, state in optimizer.state.items():
                if (p.to_local() if hasattr(p, "to_local") else p).numel() >= 4096:
                    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                        if key in state:
                            state[key] = state[key].to(torch.bfloat16)

    import torch._functorch.config as functorch_config

    base = {"bf16": AdamWBf16States, "8bit": AdamW8bit, "4bit": AdamW4bit}[cfg.optimizer_state]

    class PerRankCompiledStep(base):
        def step(self, closure=None):
            with functorch_config.patch(enable_autograd_cache=False):  # see the module's note
                return super().step(closure)

    return PerRankCompiledStep(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (quantized codes and scales included)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def nbytes(t) -> int:
        if isinstance(t, DTensor):
            t = t.to_local()
        if is_traceable_wrapper_subclass(t):
            return sum(nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def build_grad_scaler(precision: str, device):
    """fp16 needs a (sharded) gradient scaler; bf16 and fp32 none."""
    if precision != "fp16":
        return None

    return ShardedGradScaler(device=device.type)


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then decay. These are
    transformers' schedules exactly, with its warmup read one step ahead (ours trains the first step at
    lr/warmup, not 0): tests/train/test_lr_schedule.py; calling them takes more code than this."""
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


def schedule_change(saved: dict, now: TrainConfig, step: int, steps_per_epoch: int) -> str | None:
    """A resume from step `step` trains on this run's schedule; where the checkpoint's run (its
    train config, `saved`) had trained the next step at another lr, one line says so: a raised
    train.max_steps or epochs stretches the decay and the lr jumps back up, without a word before."""
    old = known_fields(TrainConfig, saved)
    then_total, total = total_steps(old, steps_per_epoch), total_steps(now, steps_per_epoch)
    then, lr = lr_at(step, then_total, old), lr_at(step, total, now)
    if math.isclose(then, lr, rel_tol=1e-9, abs_tol=0.0):
        return None
    span = f"{total} steps, the checkpoint's run {then_total}" if total != then_total else f"{total} steps"
    return (f"learning rate: step {step + 1} trains at {lr:.4g}, where the checkpoint's run was at {then:.4g}: "
            f"the schedule is this run's ({now.lr_schedule} over {span}), taken up at step {step}")


def set_lr(optimizer, lr: float) -> None:
    """Every group at `lr` times its own scale (LoRA+'s B matrices: the ratio)."""
    for group in optimizer.param_groups:
        group_lr = lr * group.get("lr_scale", 1.0)
        if torch.is_tensor(group["lr"]):  # torchao keeps it a tensor (no recompile when it changes)
            group["lr"].fill_(group_lr)
        else:
            group["lr"] = group_lr


def total_steps(t: TrainConfig, steps_per_epoch: int) -> int:
    """train.max_steps, else train.epochs (the decimal written, exactly: 0.29 x 100 is 28.999... in floats)
    of this data's steps, rounded down, at least one; it may pass any step counter (2**63-1)."""
    if t.max_steps > 0:
        return t.max_steps
    steps = Fraction(repr(t.epochs)) * steps_per_epoch
    if steps > INT_LIMIT:
        raise UserError(f"train.epochs={t.epochs:g} is {t.epochs * steps_per_epoch:.3g} optimizer steps of this data "
                        f"({steps_per_epoch} per epoch), more than 2**63-1; give fewer train.epochs, "
                        "or set train.max_steps")
    return max(1, math.floor(steps))
