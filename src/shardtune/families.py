"""What shardtune knows about each model family, in one table keyed by Hugging Face `model_type`.

Adding an architecture touches this table only (CONTRIBUTING.md, "Adding a model architecture").
It imports nothing, so the CLI, the config checks and every layer (the FSDP code, document masking,
adapters, the chunked loss) can read it. `tests/test_architectures.py` builds a tiny model of every
family (tests/archs.py) and checks each fact against it, so an entry cannot drift from
transformers' modeling code; the README's architecture table is rendered from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    block: str  # class name of the decoder block: one FSDP unit, the unit of activation checkpointing
    # default LoRA target modules (short names), only where shardtune chooses itself: None takes
    # peft's maintained per-architecture mapping (model/adapters.py). Mixture-of-experts models get
    # the attention projections only: their experts are fused 3-D parameters, not linear layers
    lora_targets: tuple[str, ...] | None
    # the causal-LM forward applies the LM head (a plain linear layer) and nothing else to the logits,
    # no soft-capping or scaling, so a loss computed inside the head is the model's loss (model/loss.py)
    plain_head: bool
    # how its forward keeps attention inside each document of a packed row (data/docmask.py):
    # "position_ids" (transformers builds the block-causal mask from the position restarts),
    # "mask_4d" (shardtune builds the mask and passes it), or None (a document does not compute
    # what it computes alone: refused; the reason is in the entry's comment)
    document_mask: str | None
    # module-name suffixes, inside one decoder block, of the matmuls of attention and of the MLP
    # (a module may hold fused weights, e.g. Mixtral's experts): for memory features that act on
    # one kind of matmul (selective checkpointing, offloading, quantization)
    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    # default IA3 (targets, feed-forward targets), only where shardtune chooses itself: None takes
    # peft's mapping. Mixture-of-experts models: attention only (fused experts are no linear layers)
    ia3_targets: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    # peft's prefix tuning fits its attention cache (one key and value per attention or key/value
    # head); False: multi-query or latent attention caches other shapes, so it is refused
    prefix_tuning: bool = True
    # the block, or the head (one with a bias) and so the root, returns a view, which FSDP2 warns
    # about (an in-place write by the caller would drop its pre-backward hook); True only where the
    # model never writes into them and the gradients are checked against the unwrapped model
    # (tests/model/test_build.py): the warning is then silenced (distributed/fsdp.py)
    view_output_checked: bool = False
    # module-name suffix of a norm between the token embeddings and the first block: frozen with the
    # embeddings under freeze.trainable_blocks (trained, backward ran through every frozen block to
    # reach it). Only the forward tells it (LFM2's final norm is named embedding_norm):
    # tests/test_architectures.py checks it against the order the forward runs the modules
    embedding_norm: str | None = None


_QV = ("q_proj", "v_proj")
_PEFT = None  # peft's default targets for this model type
_POS, _4D = "position_ids", "mask_4d"
_LLAMA_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LLAMA_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NEOX_MLP = ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
_FUSED_ATTENTION = ("attention.query_key_value", "attention.dense")
_GPT2_ATTENTION = ("attn.c_attn", "attn.c_proj")
_GPT2_MLP = ("mlp.c_fc", "mlp.c_proj")
_MOE = ("mlp.gate", "mlp.experts")  # router and fused experts
_MOE_ROUTER = ("mlp.router", "mlp.experts")


_IA3_LLAMA = (("k_proj", "v_proj", "down_proj"), ("down_proj",))  # peft's choice for llama
_IA3_MOE = (("k_proj", "v_proj"), ())


def _llama(block: str, lora=_PEFT, plain: bool = True, mlp=_LLAMA_MLP, ia3=_PEFT) -> Family:
    return Family(block, lora, plain, _POS, _LLAMA_ATTENTION, mlp, ia3)


FAMILIES = {
    "gpt2": Family("GPT2Block", _PEFT, True, _POS, _GPT2_ATTENTION, _GPT2_MLP),
    "gpt_bigcode": Family("GPTBigCodeBlock", _PEFT, True, _POS, _GPT2_ATTENTION, _GPT2_MLP,
                          prefix_tuning=False),  # multi-query attention
    "gpt_neo": Family("GPTNeoBlock", _PEFT, True, _POS, tuple(f"attn.attention.{p}" for p in (
        "q_proj", "k_proj", "v_proj", "out_proj")), _GPT2_MLP),
    "gptj": Family("GPTJBlock", _PEFT, False, _POS,  # the head has a bias
                   ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"), ("mlp.fc_in", "mlp.fc_out"),
                   view_output_checked=True),
    "codegen": Family("CodeGenBlock", _PEFT, False, _POS,  # the head has a bias
                      ("attn.qkv_proj", "attn.out_proj"), ("mlp.fc_in", "mlp.fc_out"),
                      (("qkv_proj", "fc_out"), ("fc_out",)), view_output_checked=True),
    # ALiBi: attention biased by distance, no positions to restart
    "bloom": Family("BloomBlock", _PEFT, True, None, tuple(f"self_{p}" for p in _FUSED_ATTENTION), _NEOX_MLP,
                    embedding_norm="word_embeddings_layernorm"),
    # OPT and Falcon build their masks without the position ids: shardtune passes the 4-D mask
    "opt": Family("OPTDecoderLayer", _PEFT, True, _4D,
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"), ("fc1", "fc2"),
                  view_output_checked=True),  # `(residual + h).view(shape)`; never written into
    "falcon": Family("FalconDecoderLayer", _PEFT, True, _4D, tuple(f"self_{p}" for p in _FUSED_ATTENTION), _NEOX_MLP,
                     prefix_tuning=False),  # multi-query (7B) or grouped key/values peft miscounts
    "gpt_neox": Family("GPTNeoXLayer", _PEFT, True, _POS, _FUSED_ATTENTION, _NEOX_MLP),
    "llama": _llama("LlamaDecoderLayer"),
    "mistral": _llama("MistralDecoderLayer"),
    "qwen2": _llama("Qwen2DecoderLayer"),
    "qwen3": _llama("Qwen3DecoderLayer"),
    "gemma": _llama("GemmaDecoderLayer"),
    "gemma2": _llama("Gemma2DecoderLayer", plain=False),  # final_logit_softcapping
    "gemma3_text": _llama("Gemma3DecoderLayer", plain=False),  # final_logit_softcapping
    "stablelm": _llama("StableLmDecoderLayer", ia3=_IA3_LLAMA),
    "olmo2": _llama("Olmo2DecoderLayer", _QV, ia3=_IA3_LLAMA),
    "granite": _llama("GraniteDecoderLayer", _QV, plain=False, ia3=_IA3_LLAMA),  # logits / logits_scaling
    "cohere": _llama("CohereDecoderLayer", _QV, plain=False, ia3=_IA3_LLAMA),  # logits * logit_scale
    "smollm3": _llama("SmolLM3DecoderLayer", _QV, ia3=_IA3_LLAMA),
    "starcoder2": _llama("Starcoder2DecoderLayer", _QV, mlp=_GPT2_MLP,
                         ia3=(("k_proj", "v_proj", "mlp.c_proj"), ("mlp.c_proj",))),
    "glm4": _llama("Glm4DecoderLayer", _QV, mlp=("mlp.gate_up_proj", "mlp.down_proj"), ia3=_IA3_LLAMA),
    "phi": Family("PhiDecoderLayer", _PEFT, False, _POS,  # the head has a bias
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense"),
                  ("mlp.fc1", "mlp.fc2"), view_output_checked=True),
    "phi3": Family("Phi3DecoderLayer", ("qkv_proj",), True, _POS,
                   ("self_attn.qkv_proj", "self_attn.o_proj"), ("mlp.gate_up_proj", "mlp.down_proj"),
                   (("qkv_proj", "down_proj"), ("down_proj",))),
    # mixture of experts (the MLP entries name the router and the fused experts)
    "mixtral": _llama("MixtralDecoderLayer", mlp=_MOE, ia3=_IA3_MOE),
    "qwen2_moe": _llama("Qwen2MoeDecoderLayer", _QV, mlp=(*_MOE, "mlp.shared_expert", "mlp.shared_expert_gate"),
                        ia3=_IA3_MOE),
    "qwen3_moe": _llama("Qwen3MoeDecoderLayer", _QV, mlp=_MOE, ia3=_IA3_MOE),
    "olmoe": _llama("OlmoeDecoderLayer", _QV, mlp=_MOE, ia3=_IA3_MOE),
    "phimoe": _llama("PhimoeDecoderLayer", _QV, mlp=_MOE_ROUTER, ia3=_IA3_MOE),
    "granitemoe": _llama("GraniteMoeDecoderLayer", _QV, plain=False,  # logits / logits_scaling
                         mlp=("block_sparse_moe.router", "block_sparse_moe.experts"), ia3=_IA3_MOE),
    # builds its masks without the position ids, and its router loss cannot take a 4-D mask: refused
    "gpt_oss": Family("GptOssDecoderLayer", _QV, True, None, _LLAMA_ATTENTION, _MOE_ROUTER, _IA3_MOE),
    # LoRA on the up-projections of the low-rank query (q_proj without one) and of the keys/values
    "deepseek_v3": Family("DeepseekV3DecoderLayer", ("q_proj", "q_b_proj", "kv_b_proj"), True, _POS,
                          ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                           "self_attn.kv_b_proj", "self_attn.o_proj"), (*_MOE, "mlp.shared_experts"),
                          (("kv_b_proj",), ()), prefix_tuning=False),  # latent attention
}


# Model types outside the table whose forward keeps each document of a packed row to itself
# through the restarting position ids (data/docmask.py, "position_ids"): every causal LM of
# transformers is tried by tests/test_every_architecture.py, which fails both when one listed here
# mixes its documents and when one left out keeps them apart (then add it here).
# (Not LFM2: its checkpoints' short-convolution layers carry a document's last tokens into the next.)
PACKED_POSITIONS = frozenset({
    "apertus", "arcee", "aria_text", "axk1", "axk2", "beam", "bitnet", "cohere2", "cohere2_moe",
    "cohere_compass_text", "ctrl", "cwm", "dbrx", "deepseek_v2", "deepseek_v32", "diffllama", "doge", "dots1",
    "dots3_note", "dots3_note_text", "emu3", "ernie4_5",
    "ernie4_5_moe", "exaone4", "exaone_moe", "flex_olmo", "flint", "fuyu", "gemma3", "gemma3n_text",
    "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "git", "glm",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "got_ocr2", "gpt-sw3", "gpt_neox_japanese",
    "granite_swa", "granitemoe_swa", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe",
    "kolibri1", "laguna", "llama4", "llama4_text", "longcat_flash", "mellum", "mimo_v2_flash",
    "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mllama",
    "modernbert-decoder", "moshi", "moss_transcribe_diarize", "nanochat", "nemotron", "olmo", "olmo3",
    "persimmon", "phi4_multimodal", "seed_oss", "solar_open", "vaultgemma", "whisper", "youtu",
})


# Model types whose flash-attention layers are their own (not transformers' shared attention
# function) and drop the document lengths docmask passes (cu_seq_lens): "position_ids", they find the
# documents in the position ids, which transformers reads only in a micro-batch of one row; None,
# they see no documents at all. tests/test_architectures.py and tests/test_every_architecture.py
# find them with a CPU stand-in for the kernel (tests/archs.flash_stand_in).
FLASH_DOCUMENTS = {"falcon": "position_ids", "nemotron": "position_ids", "stablelm": "position_ids", "gpt_neo": None,
                   "gptj": None}


def document_mask_limit(hf_config) -> tuple[int, str] | None:
    """(the longest row, in tokens, in which a packed document computes what it computes alone; why)
    where the model's config limits it, else None. Falcon's ALiBi builds its bias from a padding mask,
    not the documents; Llama 4 scales the queries of its layers without RoPE by the token's index in
    the row (attn_temperature_tuning), which leaves 1 below floor_scale; GPT-Neo masks attention with
    a table of its positions, too small for a padding-free row of several documents."""
    text = text_config(hf_config)
    kind = getattr(text, "model_type", None)
    if kind == "falcon" and getattr(text, "alibi", False):
        return 0, "Falcon's ALiBi (alibi=true) takes its positions from a padding mask, not from the documents " \
                  "(its forward fails on the document mask)"
    if kind == "llama4_text" and getattr(text, "attn_temperature_tuning", False) \
            and not all(getattr(text, "no_rope_layers", None) or [1]):
        floor = int(text.floor_scale)
        return floor - 1, (f"Llama 4 scales the queries of its layers without RoPE by a token's index in its row "
                           f"(attn_temperature_tuning): from floor_scale={floor} tokens on, a packed document's "
                           f"queries are not scaled as alone")
    if kind == "gpt_neo":
        positions = int(text.max_position_embeddings)
        return positions, (f"GPT-Neo masks attention with a table of max_position_embeddings={positions} positions "
                           f"(a longer row fails)")
    return None


# A model with an adapter per language (X-MOD) reads its inputs' language from this config field when
# the forward gets no language ids, which shardtune's never passes: it must name one of the model's
# languages (the second field).
LANGUAGE_FIELDS = ("default_language", "languages")


def family(model_type: str | None) -> Family | None:
    """The family of a `model_type`, or None for one shardtune has no facts about (it still
    trains: the block is the stack nearest the token embedding (distributed/fsdp.py), LoRA's
    targets come from peft's mapping or the rule of model/adapters.default_lora_targets)."""
    return FAMILIES.get(model_type)


def with_document_mask() -> list[str]:
    """The model types whose document masking is verified, sorted (for error messages)."""
    return sorted({t for t, f in FAMILIES.items() if f.document_mask} | PACKED_POSITIONS)


# ---- The language model's sizes in a config. A multimodal config (Gemma 3, Fuyu, Mllama, ...) keeps
# them in its text sub-config; an old encoder-decoder one (mBART, Whisper), whose causal LM is the
# decoder, keeps the decoder's depth in decoder_layers. Every reader of a size goes through these.
LAYERS = ("decoder_layers", "num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN = ("hidden_size", "n_embd", "d_model")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "n_kv_heads")


def text_config(hf_config):
    """The config object that holds the language model's fields: the text sub-config that
    transformers' `get_text_config(decoder=True)` names, else the config itself (also where that
    method answers with a decoder-only copy, which a write would not reach)."""
    get = getattr(hf_config, "get_text_config", None)
    try:
        text = get(decoder=True) if get else hf_config
    except ValueError:  # several text sub-configs: none is the language model's for sure
        return hf_config
    return text if any(text is v for v in vars(hf_config).values()) else hf_config


def config_value(hf_config, *names, kind: type = int):
    """The first of `names` set (to a `kind`) in the language model's config, then in the config."""
    found = config_field(hf_config, *names, kind=kind)
    return None if found is None else found[1]


def config_field(hf_config, *names, kind: type = int) -> tuple[str, object] | None:
    """(name, value) of config_value's answer, or None: what a message names."""
    for obj in (text_config(hf_config), hf_config):
        for name in names:
            value = _global_value(obj, name)
            if isinstance(value, kind) and not isinstance(value, bool):
                return name, value
    return None


def _global_value(obj, name: str):
    """`obj.name`, or None. A heterogeneous config (per_layer_config: Gemma 4's head_dim, Dots 3's
    heads) refuses to read a field some layer overrides; its global value is the one the other
    layers have."""
    try:
        return getattr(obj, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        read_global = getattr(obj, "_getattr_without_heterogeneous_validation", None)
        if read_global is None:
            raise
        return read_global(name, None)


def layer_count(hf_config) -> int | None:
    return config_value(hf_config, *LAYERS)


def hidden_size(hf_config) -> int | None:
    return config_value(hf_config, *HIDDEN)


def layer_kinds(hf_config) -> list[tuple]:
    """One kind per layer of the language model: its entries in the per-layer patterns (the
    config's lists of one entry per layer: layer_types, mlp_layer_types, ...) and its own fields
    (per_layer_config). Layers of one kind are alike."""
    text, layers = text_config(hf_config), layer_count(hf_config) or 0
    fields = text.to_dict()
    rows = [v for v in fields.values() if isinstance(v, (list, tuple)) and len(v) == layers > 1]
    own = {int(i): repr(v) for i, v in (fields.get("per_layer_config") or {}).items()}
    return [(tuple(repr(row[i]) for row in rows), own.get(i)) for i in range(layers)]


def set_layer_count(hf_config, layers: int) -> None:
    """Give the language model of `hf_config` `layers` blocks (a shallow copy for a cheap build or
    the planner's trace): the field `layer_count` reads, and per-layer patterns (layer_types) and
    a heterogeneous config's per-layer fields (per_layer_config) cut or repeated to that depth."""
    text = text_config(hf_config)
    obj, name = next(((o, n) for o in (text, hf_config) for n in LAYERS if isinstance(getattr(o, n, None), int)),
                     (text, "num_hidden_layers"))
    pattern, depth = getattr(obj, "layer_types", None), getattr(obj, name, None)
    per_layer = obj.to_dict().get("per_layer_config") if getattr(obj, "is_heterogeneous", False) else None
    setattr(obj, name, layers)
    if isinstance(pattern, list) and pattern and len(pattern) != layers:
        obj.layer_types = [pattern[i % len(pattern)] for i in range(layers)]
    if per_layer is not None and isinstance(depth, int):  # its keys must stay below the depth
        fields = {int(i): value for i, value in per_layer.items()}
        obj.per_layer_config = {i: fields[i % depth] for i in range(layers) if i % depth in fields}
