"""The menu `shardtune plan` searches: the layouts (sharding x compute precision x activation
checkpointing x activation offloading x gradient reduction dtype) and micro-batches a recipe can
take on a target, and which layout needs at least the memory of another (the search's dominance)."""

from __future__ import annotations

import dataclasses

from shardtune.config.schema import RunConfig
from shardtune.errors import UserError
from shardtune.plan.cost import CHECKPOINTING, Candidate, Target

SHARDING_ORDER = {"full_shard": 0, "hybrid_shard": 1, "shard_grad_op": 2, "no_shard": 3}


def precisions(cfg: RunConfig, target: Target) -> list[str]:
    """The recipe's precision (fp16 where the card has no bf16), and a half precision beside fp32."""
    first = cfg.precision
    if target.gpu is not None and not target.gpu.supports(first):
        first = "fp16"
    half = "fp16" if target.gpu is not None and not target.gpu.supports("bf16") else "bf16"
    return [first] + ([half] if first == "fp32" else [])


def shardings(cfg: RunConfig, target: Target) -> list[str]:
    """Least memory first (full_shard <= shard_grad_op <= no_shard per rank)."""
    if target.world == 1:
        return ["full_shard"]  # one rank: all strategies are the same step
    return ["full_shard"] + (["hybrid_shard"] if target.nodes > 1 else []) + ["shard_grad_op", "no_shard"]


def micro_batches(cfg: RunConfig, world: int) -> list[int]:
    """Powers of two (and the recipe's own size) that keep the recipe's global batch (accumulation
    fills in)."""
    g = cfg.train.global_batch_size
    own = {cfg.train.micro_batch_size} if isinstance(cfg.train.micro_batch_size, int) else set()
    sizes = sorted({2 ** i for i in range(20)} | own)
    out = [mb for mb in sizes if mb * world <= g and g % (mb * world) == 0]
    if not out:
        raise UserError(f"train.global_batch_size={g} cannot be split over {world} ranks; set it to a multiple of "
                        f"{world}")
    return out


def checkpointing_modes(cfg: RunConfig) -> tuple[str, ...]:
    """The activation checkpointing modes the rest of the config takes (config.validation: prefix
    tuning recomputes nothing; QLoRA full or none): the menu's, and those activation_checkpointing=auto
    chooses from."""
    if cfg.peft.method == "prefix_tuning":
        return ("none",)
    if cfg.peft.quantize != "none":
        return ("none", "full")
    return CHECKPOINTING


def layouts(cfg: RunConfig, target: Target) -> list[Candidate]:
    """Every layout of the menu (as a Candidate at micro-batch 0 with fp32 state, no CPU offload)
    that train takes: the checkpointing modes of `checkpointing_modes`; QLoRA's (one GPU, no FSDP)
    no offloading and no reduction; compile=true no activation offloading (config.validation
    refuses the pair). A layout it refuses was a `run it:` line that train refused."""
    qlora = cfg.peft.quantize != "none"
    offloads = (False,) if qlora or cfg.compile is True else (False, True)
    out = []
    for precision in precisions(cfg, target):
        for sharding in shardings(cfg, target):
            for checkpointing in checkpointing_modes(cfg):
                for offload in offloads:
                    for reduce in (["fp32", "bf16"] if precision == "bf16" and not qlora else ["fp32"]):
                        out.append(Candidate(sharding, precision, 0, checkpointing, cfg.activation_checkpointing_every,
                                             offload, reduce))
    return out


def needs_at_least(heavy: Candidate, light: Candidate) -> bool:
    """Whether layout `heavy` holds at least what `light` holds in every respect: more sharded
    states, more kept activations (full < selective, every_n < none), no offloading where the
    other offloads, wider gradients, wider compute."""
    def ck(c):  # a partial order: selective and every_n are not comparable
        return {"full": 0, "none": 2}.get(c.checkpointing, 1)
    return (SHARDING_ORDER[heavy.sharding] >= SHARDING_ORDER[light.sharding]
            and (heavy.checkpointing == light.checkpointing or ck(heavy) > ck(light))
            and heavy.activation_offload <= light.activation_offload
            and (heavy.reduce_dtype == light.reduce_dtype or heavy.reduce_dtype == "fp32")
            and (heavy.precision == light.precision or heavy.precision == "fp32")
            and heavy.every == light.every)


def layout_cfg(cfg: RunConfig, layout: Candidate, target: Target) -> RunConfig:
    return dataclasses.replace(layout, micro_batch=cfg.train.micro_batch_size if
                               isinstance(cfg.train.micro_batch_size, int) else 1).apply(cfg, target)
