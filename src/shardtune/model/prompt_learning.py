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

import torch

from shardtune.config.schema import PeftConfig
from shardtune.errors import UserError


def add_prompt_learning(model, cfg: PeftConfig, seed: int | None = None, tokenizer: str | None = None):
    """Wrap `model` (a PeftModel) for prefix or prompt tuning. `tokenizer` (the run's tokenizer
    folder or hub id) turns peft.prompt_init_text into peft's TEXT init; without it (a checkpoint
    being loaded, whose weights replace the init anyway) the init is random."""
    from peft import PrefixTuningConfig, PromptTuningConfig, PromptTuningInit, get_peft_model

    tokens = cfg.virtual_tokens
    if cfg.method == "prefix_tuning":
        config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=tokens)
    elif cfg.prompt_init_text and tokenizer is not None:
        config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=tokens,
                                    prompt_tuning_init=PromptTuningInit.TEXT,
                                    prompt_tuning_init_text=cfg.prompt_init_text, tokenizer_name_or_path=tokenizer)
    else:
        config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=tokens,
                                    prompt_tuning_init=PromptTuningInit.RANDOM)
    if seed is not None:
        torch.manual_seed(seed)  # random init identical whatever the world size
    try:
        wrapped = get_peft_model(model, config)
    except ZeroDivisionError:  # peft repeats the text's tokens to fill the virtual tokens
        raise UserError(f"peft.prompt_init_text={cfg.prompt_init_text!r} is no tokens for the tokenizer "
                        f"{tokenizer!r}; give some words, or drop it for a random init") from None
    # peft also registers the base's word embeddings as `word_embeddings`: a module under two
    # names has one in DCP's state dicts and both in state_dict(), which then never match
    # (loading, resuming). A plain attribute keeps peft's use of it.
    object.__setattr__(wrapped, "word_embeddings", wrapped._modules.pop("word_embeddings"))
    if cfg.method == "prefix_tuning":
        # peft casts the prefix to the base's parameter dtype: FSDP's fp32 shards under bf16
        # compute, and the attention then meets fp32 keys. Left in the prompt encoder's own
        # dtype, the prefix comes in FSDP's compute dtype, like every other activation.
        cls = type(wrapped)
        wrapped.__class__ = type(cls.__name__, (cls,), {"base_model_torch_dtype": None})
    return wrapped


def output_offset(model) -> int:
    """Positions the model's outputs have before its first input token: the virtual tokens of a
    prompt-learning method that feeds them as inputs (prompt tuning), 0 for any other model
    (prefix tuning keeps them in the attention cache)."""
    config = getattr(model, "active_peft_config", None)
    if config is None or not config.is_prompt_learning or config.peft_type in ("PREFIX_TUNING", "CARTRIDGE"):
        return 0
    return config.num_virtual_tokens
