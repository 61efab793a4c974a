"""The families table (shardtune/families.py) checked against transformers' modeling code: a
tiny model of every family, built on the meta device, has the block class, the LoRA targets and
the attention/MLP modules the table names."""

from __future__ import annotations

import pytest

from shardtune.families import FAMILIES, family

# small enough to build instantly; keys a family does not know become ignored config attributes
SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 2, "vocab_size": 100, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1,
         "n_layer": 1, "n_embd": 32, "n_head": 2, "ffn_dim": 64, "word_embed_proj_dim": 32, "num_local_experts": 2}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_facts_match_the_model(model_type):
    import torch
    import torch.nn as nn
    from transformers import AutoConfig, AutoModelForCausalLM

    facts = FAMILIES[model_type]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL))
    blocks = [m for m in model.modules() if type(m).__name__ == facts.block]
    assert len(blocks) == 1, f"{model_type}: no single {facts.block} in a 1-layer model"
    assert facts.block in model._no_split_modules  # transformers agrees on the unit
    inside = {name for name, _ in blocks[0].named_modules() if name}
    short = {name.rsplit(".", 1)[-1] for name in inside}
    assert set(facts.lora_targets) <= short, f"{model_type}: LoRA targets {facts.lora_targets} not in {sorted(short)}"
    for kind in (facts.attention, facts.mlp):
        assert kind and set(kind) <= inside, f"{model_type}: {kind} not modules of {facts.block}: {sorted(inside)}"
    assert not set(facts.attention) & set(facts.mlp)
    head = model.get_output_embeddings()
    if facts.plain_head:
        assert type(head) is nn.Linear and head.bias is None
    assert facts.document_mask in (None, "position_ids", "mask_4d")


def test_an_unknown_family_has_no_facts():
    assert family("bloom") is None and family(None) is None
