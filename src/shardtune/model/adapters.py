"""Parameter-efficient fine-tuning: LoRA through `peft`, and layer freezing.

Both run on the meta-device skeleton *and* on rank 0's source model (the same function, seeded),
so their parameter names match when the weights are broadcast. FSDP2 keeps frozen and trainable
parameters in one unit, so any sharding strategy works with them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardtune.config.schema import FreezeConfig, PeftConfig
from shardtune.errors import UserError
from shardtune.families import family


def check_quantize(cfg: PeftConfig, device) -> None:
    if cfg.quantize == "none":
        return
    if device.type != "cuda":
        raise UserError("peft.quantize=4bit (QLoRA) needs a CUDA GPU and bitsandbytes; "
                        "on this machine use peft.quantize=none (plain LoRA)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("peft.quantize=4bit needs bitsandbytes; pip install bitsandbytes") from None


def quantization_config(cfg: PeftConfig):
    """bitsandbytes NF4 with bf16 storage, so FSDP can shard the quantized weights like bf16."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)


def load_qlora_model(cfg, hf_config, device, world_size: int, seed: int):
    """QLoRA: bitsandbytes loads the base straight onto this GPU in NF4, LoRA adapters go on top.
    One rank only — the 4-bit weights are small enough for one card and are not FSDP-sharded."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    if world_size > 1:
        raise UserError("peft.quantize=4bit runs on one GPU; use --nproc 1, or peft.quantize=none for "
                        "sharded LoRA on several GPUs")
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.name_or_path, config=hf_config, quantization_config=quantization_config(cfg.peft),
        dtype=torch.bfloat16, device_map={"": device.index or 0}, trust_remote_code=cfg.model.trust_remote_code)
    # fp32 norms and embeddings-output grads, optional checkpointing: the usual k-bit preparation.
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.activation_checkpointing == "full",
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    return add_lora(model, cfg.peft, hf_config.model_type, seed)


def add_lora(model, cfg: PeftConfig, model_type: str, seed: int | None = None):
    """Wrap `model` with LoRA adapters (a PeftModel); the base weights are frozen by peft."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    # a default may name variants of one projection (DeepSeek-V3's q_proj, or q_b_proj with a
    # low-rank query): those of this model
    targets = cfg.target_modules or [t for t in default_lora_targets(model_type, model) or [] if t in names]
    if not targets:
        raise UserError(f"no default LoRA target modules for model_type {model_type!r}; "
                        "set peft.target_modules=[...] (names of linear layers)")
    missing = [t for t in targets if t not in names]
    if missing:
        raise UserError(f"peft.target_modules {missing} are not modules of this {model_type} model; "
                        f"choose among its linear layers: {', '.join(_linear_names(model)[:12])}")
    if seed is not None:
        torch.manual_seed(seed)  # adapter init identical whatever the world size
    lora = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      task_type="CAUSAL_LM", bias="none")
    try:
        return get_peft_model(model, lora)
    except ValueError:  # e.g. a target that is a whole attention block, not a linear layer
        kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets})
        raise UserError(f"peft.target_modules={targets} names {', '.join(kinds) or 'modules'}, which cannot take "
                        f"LoRA adapters; name linear layers, e.g. {', '.join(_linear_names(model)[:12])}") from None


def default_lora_targets(model_type: str | None, model=None) -> list[str] | None:
    """LoRA's targets without `peft.target_modules`: shardtune's own choice where the families
    table makes one, else peft's maintained per-architecture mapping, else (given the model) the
    rule below, else None."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    known = family(model_type)
    if known and known.lora_targets:
        return list(known.lora_targets)
    targets = PEFT_TARGETS.get(model_type)
    if targets:
        return list(targets)
    if model is None:
        return None
    # The rule for an architecture neither names: the linear layers inside the decoder blocks
    # (peft's "all-linear", less the head and whatever lies outside the blocks, e.g. a vision
    # tower), narrowed to attention's where the blocks have some, as peft's mapping mostly does.
    # A short name shared by attention and the MLP (GPT-2's c_proj) would adapt both: left out.
    from shardtune.distributed.fsdp import detect_block_class

    try:
        block_cls = detect_block_class(model)
    except UserError:
        return _linear_names(model) or None
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as peft_refuses  # Mamba's out_proj

    attention, other = set(), set()
    for block in (m for m in model.modules() if isinstance(m, block_cls)):
        for path in _linear_names(block, full=True):
            name = path.rsplit(".", 1)[-1]
            try:
                peft_refuses(LoraConfig(target_modules=[name]), model, name)
            except ValueError:
                continue
            in_attention = any("attn" in part or "attention" in part for part in path.lower().split(".")[:-1])
            (attention if in_attention else other).add(name)
    return sorted(attention - other) or sorted(attention) or sorted(other) or None


def _linear_names(model, full: bool = False) -> list[str]:
    """Short names (`full`: the paths) of the layers LoRA can adapt (Linear, and GPT-2's Conv1D),
    sorted, without the head."""

    names = {name if full else name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    return sorted(n for n in names if n.rsplit(".", 1)[-1] not in {"lm_head", "score"})


def adapt(model, peft: PeftConfig, freeze_cfg: FreezeConfig, block_cls: type, seed: int | None = None):
    """LoRA or freezing as the config asks (config.validate refuses both at once); returns the
    (possibly wrapped) model."""
    if peft.method == "lora":
        return add_lora(model, peft, model.config.model_type, seed)
    if peft.method != "none":
        raise UserError(f"peft.method={peft.method} is not built yet; use peft.method=lora")
    freeze(model, freeze_cfg, block_cls)
    return model


def freeze(model, cfg: FreezeConfig, block_cls: type) -> None:
    """Turn off gradients: they then get no gradient and no optimizer state."""

    if cfg.trainable_blocks is None and not cfg.head_only and not cfg.embeddings:
        return
    if cfg.head_only:
        model.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(True)
        return
    freeze_embeddings = cfg.embeddings
    if cfg.trainable_blocks is not None:
        blocks = [m for m in model.modules() if isinstance(m, block_cls)]
        if not 0 <= cfg.trainable_blocks <= len(blocks):
            raise UserError(f"freeze.trainable_blocks={cfg.trainable_blocks} but the model has {len(blocks)} "
                            f"blocks; choose 0..{len(blocks)}")
        # Below the top N blocks everything is frozen (embeddings included); above them, the
        # final norm stays trainable. An untied LM head is frozen too: it is the largest matrix.
        for block in blocks[:len(blocks) - cfg.trainable_blocks]:
            block.requires_grad_(False)
        head = model.get_output_embeddings()
        if head is not None:
            head.requires_grad_(False)
        freeze_embeddings = True
    if freeze_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.requires_grad_(False)
