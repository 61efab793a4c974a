"""Tiny random-init configs of every architecture in the families table (shardtune/families.py),
in one place: a few hundred thousand parameters each, built in well under a second, no hub.
Values that default to a no-op (Granite's logits_scaling=1) are set so that what the table
claims about the family can be seen in the numbers."""

from __future__ import annotations

COMMON = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 300, "bos_token_id": 0,
          "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": False}
_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128}
# every layer a mixture of experts, with the router's load-balancing loss on
_MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "output_router_logits": True, "router_aux_loss_coef": 0.02}
ARCHS = {
    "gpt2": _GPT2,
    "gpt_bigcode": _GPT2,
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": 16},
    "gptj": {**_GPT2, "rotary_dim": 8},
    "codegen": {**_GPT2, "n_ctx": 128, "rotary_dim": 8},
    "bloom": {"n_layer": 2, "n_head": 4},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "falcon": {},
    "gpt_neox": {},
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "final_logit_softcapping": 0.5},
    "gemma3_text": {"head_dim": 16, "final_logit_softcapping": 0.5},
    "stablelm": {},
    "olmo2": {},
    "granite": {"logits_scaling": 2.0},
    "cohere": {"logit_scale": 0.5},
    "smollm3": {},
    "starcoder2": {},
    "glm4": {"head_dim": 16},
    "phi": {},
    "phi3": {},
    "mixtral": _MOE,
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**_MOE, "head_dim": 16},
    "olmoe": _MOE,
    "phimoe": _MOE,
    "granitemoe": {**_MOE, "logits_scaling": 2.0},
    "gpt_oss": {**_MOE, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # multi-head latent attention wants as many K/V heads as query heads; layer 0 dense, layer 1 MoE
    "deepseek_v3": {**_MOE, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
}


def arch_config(model_type: str) -> dict:
    """The tiny config of `model_type` as a `model.config` dict (with its model_type)."""
    return {"model_type": model_type, **COMMON, **ARCHS[model_type]}


def hf_config(model_type: str, **extra):
    from transformers import AutoConfig

    cfg = {**arch_config(model_type), **extra}
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
