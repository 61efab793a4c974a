"""Prompt learning through `peft`: prefix tuning and prompt tuning. The base stays frozen; what
trains is one small embedding table in the PeftModel itself, outside the decoder blocks (so in
FSDP's root unit).

- prompt tuning learns `num_virtual_tokens` input embeddings that peft puts before every
  sequence: the model's outputs are that many positions longer than its inputs, and the loss
  (train.step.token_loss) pads the labels on the left by `output_offset(model)`;
- prefix tuning learns keys and values of that many virtual tokens for every layer, handed to
  the model as its attention cache: the outputs stay aligned with the inputs, and the real
  tokens' positions start after the prefix.

Either way the real tokens sit behind the virtual ones, so seq_len + virtual tokens must fit the
model's positions (model.hf.check_seq_len).
"""

from __future__ import annotations

from shardtune.config.schema import PeftConfig
from shardtune.errors import UserError
from shardtune.families import family


def check_model(cfg: PeftConfig, hf_config) -> None:
    """What prefix tuning needs of the model (families.Family.prefix_tuning), before any work."""
    if cfg.method != "prefix_tuning":
        return
    model_type = getattr(hf_config, "model_type", None)
    known = family(model_type)
    if known is not None and not known.prefix_tuning:
        raise UserError(f"peft.method=prefix_tuning does not fit the attention cache of model type {model_type!r} "
                        "(its multi-query or latent attention keeps other key/value shapes than peft's prefix); "
                        "use peft.method=prompt_tuning or lora")
    if getattr(hf_config, "output_router_logits", False):
        # transformers' load-balancing loss takes the attention mask, which peft lengthens by the prefix
        raise UserError("peft.method=prefix_tuning does not combine with the router's load-balancing loss "
                        "(output_router_logits: it would count the prefix as tokens); set output_router_logits "
                        "to false in model.config, or use peft.method=prompt_tuning")


def prefix_tuning_config(model, cfg: PeftConfig, init: bool):
    """Keys and values of the virtual tokens for every layer (peft reads the layer count and
    the key/value heads of the model config)."""
    from peft import PrefixTuningConfig

    return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=cfg.virtual_tokens)


def prompt_tuning_config(model, cfg: PeftConfig, init: bool):
    """Input embeddings of the virtual tokens, random (peft.prompt_init_text: see `init_text`),
    as wide as the model's token embeddings: peft takes the hidden size, which OPT's
    word_embed_proj_dim (projected up after the lookup) differs from, and the first forward failed."""
    from peft import PromptTuningConfig, PromptTuningInit

    return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=cfg.virtual_tokens,
                              prompt_tuning_init=PromptTuningInit.RANDOM,
                              token_dim=model.get_input_embeddings().weight.shape[-1])


def init_text(peft_config, cfg: PeftConfig, tokenizer: str | None):
    """peft's TEXT init of prompt tuning (the virtual tokens start as the embeddings of
    peft.prompt_init_text's tokens, repeated or cut to length), read with the run's tokenizer
    (a folder or hub id it has already loaded). Without a tokenizer (a skeleton, or a model
    whose weights are loaded next) or a text, the config is left as it is."""
    from peft import PromptTuningInit

    if tokenizer is None or not cfg.prompt_init_text or cfg.method != "prompt_tuning":
        return peft_config
    peft_config.prompt_tuning_init = PromptTuningInit.TEXT
    peft_config.prompt_tuning_init_text = cfg.prompt_init_text
    peft_config.tokenizer_name_or_path = tokenizer
    return peft_config


def fit_for_fsdp(wrapped):
    """A prompt-learning PeftModel made safe to shard and load by name (others pass unchanged)."""
    if not getattr(wrapped.active_peft_config, "is_prompt_learning", False):
        return wrapped
    # peft also registers the base's word embeddings as `word_embeddings`: a module under two
    # names has one in DCP's state dicts and both in state_dict(), which then never match
    # (loading, resuming). A plain attribute keeps peft's use of it.
    if "word_embeddings" in wrapped._modules:
        object.__setattr__(wrapped, "word_embeddings", wrapped._modules.pop("word_embeddings"))
    if wrapped.active_peft_config.peft_type == "PREFIX_TUNING" and wrapped.base_model_torch_dtype is not None:
        # peft casts the prefix to the base's parameter dtype: FSDP's fp32 shards under bf16
        # compute, and the attention then meets fp32 keys. Left in the prompt encoder's own
        # dtype, the prefix comes in FSDP's compute dtype, like every other activation.
        cls = type(wrapped)
        wrapped.__class__ = type(cls.__name__, (cls,), {"base_model_torch_dtype": None})
    return wrapped


def adapter_state_dict(peft_model, state_dict: dict) -> dict:
    """The tensors of peft's adapter file, from the model's full `state_dict` (gathered from its
    shards). peft reads a prompt-learning adapter from the live prompt encoder instead, whose
    weight is a DTensor shard under FSDP; without a projection (shardtune sets none) what it
    saves is that weight itself."""
    from peft import get_peft_model_state_dict

    config = peft_model.active_peft_config
    if not config.is_prompt_learning:
        return get_peft_model_state_dict(peft_model, state_dict=state_dict)
    assert not getattr(config, "prefix_projection", False), "a prefix projection saves its MLP's output"
    return {"prompt_embeddings": state_dict[f"prompt_encoder.{peft_model.active_adapter}.embedding.weight"]}


def virtual_tokens(model) -> int:
    """The positions a prompt-learning PeftModel's virtual tokens take before every sequence (0:
    any other model)."""
    config = getattr(model, "active_peft_config", None)
    return config.num_virtual_tokens if config is not None and config.is_prompt_learning else 0


def output_offset(model) -> int:
    """Positions the model's outputs have before its first input token: the virtual tokens of a
    prompt-learning method that feeds them as inputs (prompt tuning), 0 for any other model
    (prefix tuning keeps them in the attention cache)."""
    count = virtual_tokens(model)
    return 0 if not count or model.active_peft_config.peft_type in ("PREFIX_TUNING", "CARTRIDGE") else count
