"""What shardtune knows about each model family, in one table keyed by Hugging Face `model_type`.

Adding an architecture touches this table only (CONTRIBUTING.md, "Adding a model architecture").
It imports nothing, so the CLI, the config checks and every layer (the FSDP code, document masking,
adapters, the chunked loss) can read it. `tests/test_families.py` builds a tiny model of every
family on the meta device and checks each fact against it, so an entry cannot drift from
transformers' modeling code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    block: str  # class name of the decoder block: one FSDP unit, the unit of activation checkpointing
    lora_targets: tuple[str, ...]  # default LoRA target modules (short names): the attention projections
    # the causal-LM forward applies the LM head (a plain linear layer) and nothing else to the logits,
    # no soft-capping or scaling, so a loss computed inside the head is the model's loss (model/loss.py)
    plain_head: bool
    # how its forward keeps attention inside each document of a packed row (data/docmask.py):
    # "position_ids" (transformers builds the block-causal mask from the position restarts),
    # "mask_4d" (shardtune builds the mask and passes it), or None (not verified: refused)
    document_mask: str | None
    # module-name suffixes, inside one decoder block, of the matmuls of attention and of the MLP
    # (a module may hold fused weights, e.g. Mixtral's experts): for memory features that act on
    # one kind of matmul (selective checkpointing, offloading, quantization)
    attention: tuple[str, ...]
    mlp: tuple[str, ...]


_QV = ("q_proj", "v_proj")
_LLAMA_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LLAMA_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NEOX_MLP = ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")

FAMILIES = {
    "gpt2": Family("GPT2Block", ("c_attn",), True, "position_ids",
                   ("attn.c_attn", "attn.c_proj"), ("mlp.c_fc", "mlp.c_proj")),
    "opt": Family("OPTDecoderLayer", _QV, True, "mask_4d",
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"), ("fc1", "fc2")),
    "llama": Family("LlamaDecoderLayer", _QV, True, "position_ids", _LLAMA_ATTENTION, _LLAMA_MLP),
    "mistral": Family("MistralDecoderLayer", _QV, True, "position_ids", _LLAMA_ATTENTION, _LLAMA_MLP),
    "mixtral": Family("MixtralDecoderLayer", _QV, False, None, _LLAMA_ATTENTION, ("mlp.gate", "mlp.experts")),
    "qwen2": Family("Qwen2DecoderLayer", _QV, True, "position_ids", _LLAMA_ATTENTION, _LLAMA_MLP),
    "qwen3": Family("Qwen3DecoderLayer", _QV, True, None, _LLAMA_ATTENTION, _LLAMA_MLP),
    "gemma": Family("GemmaDecoderLayer", _QV, False, None, _LLAMA_ATTENTION, _LLAMA_MLP),
    "phi3": Family("Phi3DecoderLayer", ("qkv_proj",), False, None,
                   ("self_attn.qkv_proj", "self_attn.o_proj"), ("mlp.gate_up_proj", "mlp.down_proj")),
    "gpt_neox": Family("GPTNeoXLayer", ("query_key_value",), True, "position_ids",
                       ("attention.query_key_value", "attention.dense"), _NEOX_MLP),
    "falcon": Family("FalconDecoderLayer", ("query_key_value",), False, None,
                     ("self_attention.query_key_value", "self_attention.dense"), _NEOX_MLP),
}


def family(model_type: str | None) -> Family | None:
    """The family of a `model_type`, or None for one shardtune has no facts about (it still
    trains: the block comes from `_no_split_modules`, LoRA needs `peft.target_modules`)."""
    return FAMILIES.get(model_type)


def with_document_mask() -> list[str]:
    """The model types whose document masking is verified, sorted (for error messages)."""
    return sorted(t for t, f in FAMILIES.items() if f.document_mask)
