"""The one way a model is built for a command: train, eval, plan and sweep all call
`build_model`, so what they run (and what the planner traces) is the same model.

The sequence: the model's structure on the meta device -> Liger-Kernel's fused kernels
(kernels=liger) -> peft adapters / freezing -> the chunked (or Liger's fused) head loss -> float8
linear layers -> parallelism (distributed.fsdp.apply_parallelism) -> weights,
read on rank 0 only and handed out shard by shard. Without a weight source the parameters stay
on meta, for the caller to give storage (the planner does so under fake tensors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardtune.config.schema import FreezeConfig, FSDPConfig, PeftConfig, RunConfig
from shardtune.errors import UserError


@dataclass
class ModelSpec:
    """Everything that decides the structure of the sharded model and nothing else."""

    hf_config: Any  # transformers PretrainedConfig
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    precision: str = "fp32"
    float8: str = "none"  # none, rowwise, tensorwise (model/float8.py)
    activation_checkpointing: str = "none"  # none, full, selective, every_n
    activation_checkpointing_every: int = 2
    activation_offload: bool = False
    compile: bool = False
    kernels: str = "none"  # none, liger (model/kernels.py)
    loss_chunk_tokens: int | None = None
    peft: PeftConfig = field(default_factory=PeftConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    trust_remote_code: bool = False
    tokenizer: str | None = None  # the run's tokenizer (folder or hub id): peft.prompt_init_text reads it
    device_type: str | None = None  # whose sharding policy: None, the device built on (plan traces CUDA on CPU)

    @classmethod
    def of_run(cls, cfg: RunConfig, hf_config) -> ModelSpec:
        # compile=auto is train's to resolve (resolve.run); left unresolved (plan's trace, check) it builds eager
        return cls(hf_config, fsdp=cfg.fsdp, precision=cfg.precision, float8=cfg.float8,
                   activation_checkpointing=cfg.activation_checkpointing,
                   activation_checkpointing_every=cfg.activation_checkpointing_every,
                   activation_offload=cfg.activation_offload, compile=cfg.compile is True, kernels=cfg.kernels,
                   loss_chunk_tokens=cfg.loss_chunk_tokens, peft=cfg.peft, freeze=cfg.freeze,
                   trust_remote_code=cfg.model.trust_remote_code,
                   tokenizer=cfg.model.tokenizer or cfg.model.name_or_path)


@dataclass
class BuiltModel:
    """The model and what the training step needs to know about how it is sharded."""

    model: Any  # nn.Module, its parameters DTensors (FSDP2) unless it is a QLoRA model
    block_cls: type | None  # the decoder-block class (one FSDP unit each with fsdp.wrap=block)
    units: list  # the FSDP units below the root, in forward order
    reshard_after_forward: bool  # distributed.fsdp.reshard_after_forward: the one sharding policy
    loaded: str = "none"  # how the weights came: "sharded" (each rank its slices), "rank 0" (broadcast), "none"

    @property
    def sync_grads_each_micro_step(self) -> bool:
        """Reduce-scatter gradients after every micro-batch where parameters are resharded
        (gradients stay sharded too: memory), else once per step (no traffic per micro-batch)."""
        return self.reshard_after_forward


def check_machine(cfg: RunConfig, device) -> None:
    """The machine's part of the config checks (config validation did the config's part), before
    anything is built: QLoRA, float8 and kernels=liger need CUDA, float8 compute capability 8.9+,
    kernels=liger Liger-Kernel installed."""
    from shardtune.model import float8, kernels
    from shardtune.model.adapters import check_quantize

    check_quantize(cfg.peft, device)
    float8.check_device(cfg.float8, device)
    kernels.check(cfg.kernels, device)


def skeleton(spec: ModelSpec) -> tuple[Any, type]:
    """The model of `spec` on the meta device with its kernels and its adapters or freezing, and
    its decoder-block class: the build's first steps (structure only: values come from rank 0)."""
    from shardtune.distributed.fsdp import detect_block_class
    from shardtune.model import kernels
    from shardtune.model.adapters import adapt
    from shardtune.model.hf import build_meta_model

    model = build_meta_model(spec.hf_config, spec.trust_remote_code)
    block_cls = detect_block_class(model, spec.fsdp.block_class)
    kernels.apply(model, spec.kernels)  # the plain HF modules, before adapters wrap them
    return adapt(model, spec.peft, spec.freeze, block_cls, init=False), block_cls


def check_structure(spec: ModelSpec) -> None:
    """What only the model's structure can tell of the peft method's targets, the blocks freezing
    keeps, fsdp.block_class and size-based units under selective checkpointing: refused on the meta
    skeleton (milliseconds, under a second for 7B), before any data is read or weight built.
    Liger's kernels keep the module names: left out."""
    inner_units = spec.fsdp.wrap == "size" and spec.activation_checkpointing == "selective"
    freezes = spec.freeze != FreezeConfig()
    if not (spec.peft.adapter or freezes or spec.fsdp.block_class or inner_units):
        return
    model, block_cls = skeleton(dataclasses.replace(spec, kernels="none"))
    if freezes:
        _check_something_trains(model, spec.freeze)
    if inner_units:
        _check_units_outside_blocks(model, block_cls, spec.fsdp.min_num_params)


def _check_something_trains(model, freeze: FreezeConfig) -> None:
    """Freezing that leaves no parameter to train (trainable_blocks=0 on a model with no final norm
    outside its blocks, OPT's with do_layer_norm_before=false): the optimizer had nothing to take."""
    if any(p.requires_grad for p in model.parameters()):
        return
    given = " ".join(f"freeze.{k}={str(v).lower()}" for k, v in dataclasses.asdict(freeze).items()
                     if v != getattr(FreezeConfig(), k))
    raise UserError(f"{given} leaves this {model.config.model_type} model no parameter to train (nothing outside "
                    "its frozen blocks and embeddings); set freeze.trainable_blocks=1 or more")


def _check_units_outside_blocks(model, block_cls: type, min_num_params: int) -> None:
    """Selective checkpointing replays a block's ops in backward from what forward cached, op by
    op: an FSDP unit inside the block runs other ops when it is recomputed (its gathers and their
    record_function markers), which the cache does not hold (torch raises mid-backward)."""
    from shardtune.distributed.fsdp import size_based_units

    blocks = [m for m in model.modules() if isinstance(m, block_cls)]
    inside = {id(m): name for b in blocks for name, m in b.named_modules() if m is not b}
    units = [inside[id(u)] for u in size_based_units(model, min_num_params) if id(u) in inside]
    if units:
        largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        raise UserError(f"activation_checkpointing=selective cannot recompute a decoder block that holds FSDP units, "
                        f"and fsdp.wrap=size with fsdp.min_num_params={min_num_params} makes {len(units)} inside the "
                        f"blocks (e.g. {units[0]}); set fsdp.min_num_params={largest} or more, fsdp.wrap=block, or "
                        "activation_checkpointing=full")


def build_model(spec: ModelSpec, mesh, device, source: Callable[[], Any] | None = None,
                seed: int = 0, folder=None) -> BuiltModel:
    """The sharded model of `spec` on `mesh`. `source` returns the full-weight plain model; it
    is called on rank 0 only (collective: every rank calls build_model with a source or none).
    `folder` (safetensors): each rank reads its own slices from it instead, where the keys allow."""

    from shardtune.distributed.fsdp import apply_parallelism
    from shardtune.model import float8
    from shardtune.model import loss as loss_lib
    from shardtune.model.adapters import adapt
    from shardtune.model.hf import materialize

    model, block_cls = skeleton(spec)
    loss_lib.install(model, spec.loss_chunk_tokens, spec.kernels)  # before sharding: it checks the head's class
    float8.convert(model, block_cls, spec.float8)  # before compile and sharding: both see the float8 layers
    units, reshard = apply_parallelism(model, spec, block_cls, mesh, device)
    if folder is not None and not spec.peft.adapter:  # peft bases: names differ, broadcast
        from shardtune.model.hf_sharded_io import load_hf_sharded

        if load_hf_sharded(model, spec.hf_config, folder, device, spec.trust_remote_code, spec.fsdp.cpu_offload):
            return BuiltModel(model, block_cls, units, reshard, loaded="sharded")
    if source is not None:
        is_main = dist.get_rank() == 0
        # rank 0's copy gets the same adapters (seeded, with the method's real init: PiSSA/OLoRA's
        # residual base weights, prompt tuning's text) so that the names match the skeleton's
        full = adapt(source(), spec.peft, spec.freeze, block_cls, seed, tokenizer=spec.tokenizer) if is_main else None
        materialize(model, full, device, is_main, params_on_host=spec.fsdp.cpu_offload)
        del full
    return BuiltModel(model, block_cls, units, reshard, loaded="rank 0" if source is not None else "none")
