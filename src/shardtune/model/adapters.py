"""Parameter-efficient fine-tuning through `peft` (LoRA, DoRA, IA3, adaption prompt, ...), and
layer freezing.

Both run on the meta-device skeleton *and* on rank 0's source model (the same function, seeded),
so their parameter names match when the weights are broadcast. FSDP2 keeps frozen and trainable
parameters in one unit, so any sharding strategy works with them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardtune.config.schema import FreezeConfig, PeftConfig
from shardtune.errors import UserError
from shardtune.families import family, layer_count
from shardtune.model.prompt_learning import check_model as check_prompt_learning
from shardtune.model.prompt_learning import fit_for_fsdp, init_text, prefix_tuning_config, prompt_tuning_config

MERGEABLE_PEFT_TYPES = ("LORA", "IA3")  # adapters that fold into the base weights (DoRA is a LORA type)


def require_peft(what: str) -> None:
    """peft is an extra (`shardtune[peft]`): a run or an adapter folder that needs it, on an install
    without it, is one line naming the extra, not an ImportError from deep in the build."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError(f"{what} needs peft, which is not installed: pip install 'shardtune[peft]'") from None


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
    return add_adapter(model, cfg.peft, seed)


def add_adapter(model, cfg: PeftConfig, seed: int | None = None, init: bool = True, tokenizer: str | None = None):
    """Wrap `model` with the adapters of `cfg.method` (a PeftModel; peft freezes the base). `init`:
    the method's own initialisation (PiSSA/OLoRA decompose the base weights, prompt tuning reads
    its text with `tokenizer`); False builds the same structure with the plain init (a meta
    skeleton, or a model whose values are loaded next)."""
    require_peft(f"peft.method={cfg.method}")
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return fit_for_fsdp(model)  # a loaded adapter folder (eval's source): it has its adapters and their values
    check_method(cfg, model.config)
    peft_config = PEFT_CONFIGS[cfg.method](model, cfg, init)
    if init:
        peft_config = init_text(peft_config, cfg, tokenizer)
    _refuse_tied_head(model, getattr(peft_config, "target_modules", None), cfg.method)
    if seed is not None:
        torch.manual_seed(seed)  # adapter init identical whatever the world size
    targets = sorted(getattr(peft_config, "target_modules", None) or [])  # peft may rewrite them (a router's)
    try:
        wrapped = get_peft_model(model, peft_config)
    except ValueError as e:  # e.g. a target that is a whole attention block, not a linear layer
        kinds = ", ".join(sorted({type(m).__name__ for n, m in model.named_modules() if matches(n, targets)}))
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        if not reason.startswith("Target module"):  # another setting (a router's weight takes LoRA without dropout)
            raise UserError(f"peft refuses {cfg.method} on peft.target_modules={targets} ({kinds}): {reason[:300]}") \
                from None
        raise UserError(f"peft.target_modules={targets} names {kinds or 'modules'}, which cannot take {cfg.method} "
                        f"adapters; name linear layers, e.g. {', '.join(_linear_names(model)[:12])}") from None
    _inputs_carry_grad(model)
    return fit_for_fsdp(wrapped)


def _refuse_tied_head(model, targets, method: str) -> None:
    """An adapter on an LM head that shares its weight with the input embeddings (tied): loading
    the weights ties the pair again, which a head wrapped by an adapter cannot take, and the
    adapter would change the embeddings' lookup too."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(targets, (list, tuple, set)) or head is None or emb is None \
            or getattr(head, "weight", None) is None or head.weight is not getattr(emb, "weight", None):
        return
    name = next(n for n, m in model.named_modules() if m is head)
    if matches(name, targets):
        raise UserError(f"peft.target_modules puts {method} adapters on {name}, the LM head, whose weight is tied to "
                        f"the input embeddings (tie_word_embeddings); leave {name} out of peft.target_modules")


def _inputs_carry_grad(model) -> None:
    """The frozen token embedding's output made to require grad: a model whose blocks run inside
    an autograd Function of their own (Reformer's reversible layers) gives the adapters inside them
    no gradient when none of the Function's inputs requires one. Not transformers'
    enable_input_require_grads, whose output is a leaf that a model changing it in place (BLT)
    cannot take: a zero that requires grad is added, so the output has a grad_fn."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, nn.Module) and not any(p.requires_grad for p in embeddings.parameters()):
        embeddings.register_forward_hook(_with_grad)


def _with_grad(module, args, output):
    if not isinstance(output, torch.Tensor) or output.requires_grad or not torch.is_grad_enabled() \
            or not output.is_floating_point():
        return output
    return output + torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)


def _lora_config(model, cfg: PeftConfig, init: bool):
    """LoRA and DoRA (weight-decomposed), rsLoRA scaling, the four initialisations."""
    from peft import LoraConfig

    targets = _targets(model, cfg.target_modules, default_lora_targets(model.config.model_type, model), "LoRA")
    fused = _conv1d_targets(model, targets)
    if cfg.init == "olora":
        if fused:  # peft's OLoRA decomposes W as stored, which Conv1D keeps transposed
            raise UserError(f"peft.init=olora cannot adapt {', '.join(fused)} of this {model.config.model_type} "
                            "model (Conv1D layers, weights stored transposed); use peft.init=pissa or default")
    if cfg.residual_init:  # the adapter is r singular vectors (PiSSA) or r columns of Q (OLoRA) of each weight
        sides = {n.rsplit(".", 1)[-1]: min(m.weight.shape) for n, m in model.named_modules()
                 if matches(n, targets) and getattr(m, "weight", None) is not None and m.weight.dim() == 2}
        name, side = min(sides.items(), key=lambda item: item[1], default=(None, cfg.r))
        if cfg.r > side:
            raise UserError(f"peft.init={cfg.init} takes peft.r={cfg.r} directions from each adapted weight, but "
                            f"{name} has only {side}; set peft.r={side} or less, or peft.init=default")
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      use_dora=cfg.method == "dora", use_rslora=cfg.rslora,
                      init_lora_weights={"default": True}.get(cfg.init, cfg.init) if init else True,
                      fan_in_fan_out=bool(fused), task_type="CAUSAL_LM", bias="none")


def _conv1d_targets(model, targets) -> list[str]:
    """The targets that are GPT-2-style Conv1D layers (weights stored transposed): peft must be told
    (fan_in_fan_out), or it corrects the setting itself with a warning in every run's output."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if matches(n, targets) and type(m).__name__ == "Conv1D"})


def _ia3_config(model, cfg: PeftConfig, init: bool):
    """IA3: learned vectors scaling the keys, values and the MLP's inner activations."""
    from peft import IA3Config

    model_type = model.config.model_type
    default, default_ff = default_ia3_targets(model_type) or (None, ())
    targets = _targets(model, cfg.target_modules, default, "IA3")
    ff = cfg.feedforward_modules if cfg.feedforward_modules is not None else [t for t in default_ff if t in targets]
    if not set(ff) <= set(targets):
        raise UserError(f"peft.feedforward_modules {sorted(set(ff) - set(targets))} are not in peft.target_modules "
                        f"{targets}; list each feed-forward module among the targets too")
    return IA3Config(target_modules=targets, feedforward_modules=ff,
                     fan_in_fan_out=bool(_conv1d_targets(model, targets)), task_type="CAUSAL_LM")


def _adaption_prompt_config(model, cfg: PeftConfig, init: bool):
    """LLaMA-Adapter: learned tokens and a zero-init gate in the attention of the top layers."""
    from peft import AdaptionPromptConfig

    return AdaptionPromptConfig(adapter_len=cfg.adapter_len or cfg.DEFAULT_ADAPTER_LEN,
                                adapter_layers=cfg.adapter_layers or layer_count(model.config),
                                task_type="CAUSAL_LM")


PEFT_CONFIGS = {"lora": _lora_config, "dora": _lora_config, "ia3": _ia3_config,
                "adaption_prompt": _adaption_prompt_config, "prefix_tuning": prefix_tuning_config,
                "prompt_tuning": prompt_tuning_config}  # peft.method -> its peft config


def peft_config_of(adapter_config: dict) -> PeftConfig:
    """shardtune's PeftConfig of a saved adapter (adapter_config.json): its structure."""
    kind, c = adapter_config.get("peft_type"), adapter_config
    if kind in MERGEABLE_PEFT_TYPES:  # folded into the base on load: only the method matters
        return PeftConfig(method=kind.lower())
    if kind == "ADAPTION_PROMPT":
        return PeftConfig(method="adaption_prompt", adapter_len=c.get("adapter_len"),
                          adapter_layers=c.get("adapter_layers"))
    if kind in ("PREFIX_TUNING", "PROMPT_TUNING"):
        return PeftConfig(method=kind.lower(), num_virtual_tokens=c.get("num_virtual_tokens"))
    raise UserError(f"an adapter folder of peft_type {kind} is not one shardtune loads; it loads lora, dora, ia3, "
                    "adaption_prompt, prefix_tuning and prompt_tuning adapters")


def check_method(cfg: PeftConfig, hf_config) -> None:
    """What the method needs of the model that its config alone cannot tell: one line, before
    any weights or data are read."""
    if cfg.adapter:
        require_peft(f"peft.method={cfg.method}")
    check_prompt_learning(cfg, hf_config)
    if cfg.method != "adaption_prompt":
        return
    from peft.tuners.adaption_prompt.config import TRANSFORMERS_MODEL_CONFIG

    model_type, layers = hf_config.model_type, layer_count(hf_config)
    if model_type not in TRANSFORMERS_MODEL_CONFIG:
        supported = ", ".join(sorted(TRANSFORMERS_MODEL_CONFIG))
        raise UserError(f"peft.method=adaption_prompt supports the model types {supported} (peft), not "
                        f"{model_type!r}; use peft.method=lora or prefix_tuning")
    if cfg.adapter_layers is not None and layers is not None and cfg.adapter_layers > layers:
        raise UserError(f"peft.adapter_layers={cfg.adapter_layers} but the model has {layers} decoder layers; "
                        f"choose 1..{layers}")


def matches(name: str, targets) -> bool:
    """peft's rule for a target: the module's full name or its dotted suffix."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _targets(model, chosen: list[str] | None, default: list[str] | None, what: str) -> list[str]:
    """`peft.target_modules`, or the default of this model type (the variants of a projection
    this model has: DeepSeek-V3's q_proj or q_b_proj); each must name modules of the model."""
    names = [name for name, _ in model.named_modules()]
    if chosen == [ALL_LINEAR]:
        chosen = all_linear(model)
    targets = chosen or [t for t in default or [] if any(matches(n, [t]) for n in names)]
    if not targets:
        raise UserError(f"no default {what} target modules for model_type {model.config.model_type!r}; "
                        "set peft.target_modules=[...] (names of linear layers)")
    missing = [t for t in targets if not any(matches(n, [t]) for n in names)]
    if missing:
        raise UserError(f"peft.target_modules {missing} are not modules of this {model.config.model_type} model; "
                        f"choose among its linear layers: {', '.join(_linear_names(model)[:12])}")
    return targets


def base_weights(peft_model, state_dict: dict) -> dict:
    """The base model's own tensors under its own names, out of a peft model's (full) state dict,
    whatever the method: the level a tuner adds around a module it wraps (LoRA/IA3's
    `base_layer`, the adaption prompt's `model`) is dropped, and the adapters' tensors are left out."""
    from peft.tuners.adaption_prompt.layer import _BaseAdaptedAttention
    from peft.tuners.tuners_utils import BaseTunerLayer

    inner = peft_model.get_base_model()  # the original model, tuner layers inside
    prefix = next(name for name, m in peft_model.named_modules() if m is inner)
    prefix = prefix + "." if prefix else ""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue  # e.g. prompt learning's prompt encoder
        module, kept, parts = inner, [], key[len(prefix):].split(".")
        for part in parts[:-1]:
            wraps = "base_layer" if isinstance(module, BaseTunerLayer) else \
                "model" if isinstance(module, _BaseAdaptedAttention) else None
            if wraps is not None and part != wraps:
                break  # an adapter's own module (lora_A, ...)
            if wraps is None:
                kept.append(part)
            module = getattr(module, part)
        else:
            if not isinstance(module, (BaseTunerLayer, _BaseAdaptedAttention)):  # its own tensors: adapters'
                out[".".join([*kept, parts[-1]])] = value
    return out


def default_lora_targets(model_type: str | None, model=None) -> list[str] | None:
    """LoRA's targets without `peft.target_modules`: shardtune's own choice where the families
    table makes one, else peft's maintained per-architecture mapping, else (given the model) the
    rule below, else None. peft's entry may be a pattern over the modules' full names (Gemma 4's:
    the language model's q_proj and v_proj, not the vision tower's): given the model, the names
    it matches; without one, None."""
    import re

    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    known = family(model_type)
    if known and known.lora_targets:
        return list(known.lora_targets)
    targets = PEFT_TARGETS.get(model_type)
    if isinstance(targets, str):  # peft's regex form (a list of short names is the other)
        targets = [n for n, _ in model.named_modules() if re.fullmatch(targets, n)] if model is not None else None
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


def default_ia3_targets(model_type: str | None) -> tuple[list[str], list[str]] | None:
    """IA3's (targets, feed-forward targets) without `peft.target_modules`: the families table's
    where it decides, else peft's per-architecture mappings, else None."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as PEFT_FF
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as PEFT_IA3

    known = family(model_type)
    if known and known.ia3_targets is not None:
        return list(known.ia3_targets[0]), list(known.ia3_targets[1])
    if model_type not in PEFT_IA3:
        return None
    return list(PEFT_IA3[model_type]), list(PEFT_FF.get(model_type, ()))


ALL_LINEAR = "all-linear"  # peft's keyword: every linear layer but the output layer


def all_linear(model) -> list[str]:
    """peft's "all-linear" made explicit, so every command counts the same adapters: the short
    names of the linear layers but the output layer (found as the model's output embeddings, not
    by its name), or their paths where a short name is also the output layer's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    paths = [path for path in _linear_names(model, full=True, keep_head=True) if model.get_submodule(path) is not head]
    heads = {path.rsplit(".", 1)[-1] for path, m in model.named_modules() if m is head}
    short = sorted({path.rsplit(".", 1)[-1] for path in paths})
    return paths if heads & set(short) else short


def _linear_names(model, full: bool = False, keep_head: bool = False) -> list[str]:
    """Short names (`full`: the paths) of the layers LoRA can adapt (Linear, and GPT-2's Conv1D),
    sorted, without the head. A Linear whose class has a forward of its own is left out: it is no
    x @ W.T (DeepSeek-V4's block-diagonal grouped o_a_proj), so peft's added x @ A.T @ B.T would
    not match its output."""

    names = {name if full else name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward) or type(m).__name__ == "Conv1D"}
    return sorted(n for n in names if keep_head or n.rsplit(".", 1)[-1] not in {"lm_head", "score"})


def adapt(model, peft: PeftConfig, freeze_cfg: FreezeConfig, block_cls: type, seed: int | None = None,
          init: bool = True, tokenizer: str | None = None):
    """A peft method or freezing as the config asks (config.validate refuses both at once);
    returns the (possibly wrapped) model. `tokenizer`: the run's, for peft.prompt_init_text."""
    if peft.adapter:
        return add_adapter(model, peft, seed, init, tokenizer)
    freeze(model, freeze_cfg, block_cls)
    return model


def freeze(model, cfg: FreezeConfig, block_cls: type) -> None:
    """Turn off gradients: they then get no gradient and no optimizer state."""

    if cfg.trainable_blocks is None and not cfg.head_only and not cfg.embeddings:
        return
    if cfg.head_only:  # the head's weight and its bias (GPT-J's, Phi's)
        model.requires_grad_(False)
        model.get_output_embeddings().requires_grad_(True)
        return
    freeze_embeddings = cfg.embeddings
    if cfg.trainable_blocks is not None:
        from shardtune.distributed.fsdp import decoder_blocks

        blocks = decoder_blocks(model, block_cls)
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
        known = family(model.config.model_type)
        if known and known.embedding_norm:  # before the blocks: frozen with the embeddings
            for name, module in model.named_modules():
                if matches(name, [known.embedding_norm]):
                    module.requires_grad_(False)
        freeze_embeddings = True
    if freeze_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.requires_grad_(False)

