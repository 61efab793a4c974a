"""The families table (shardtune/families.py): its lookups. Each entry's facts are checked
against a tiny model of the family in tests/test_architectures.py."""

from __future__ import annotations

from shardtune.families import FAMILIES, PACKED_POSITIONS, family, with_document_mask


def test_an_unknown_family_has_no_facts():
    assert family("mamba") is None and family(None) is None


def test_document_mask_list_is_the_table_s_and_the_packed_positions_types():
    assert with_document_mask() == sorted({t for t, f in FAMILIES.items() if f.document_mask is not None}
                                          | PACKED_POSITIONS)
    assert not PACKED_POSITIONS & set(FAMILIES)  # a table row says it in its own entry
    assert "llama" in with_document_mask() and "bloom" not in with_document_mask()


def test_sizes_are_read_from_the_language_model_s_config():
    """A multimodal config keeps its sizes in the text sub-config, an old encoder-decoder one (whose
    causal LM is the decoder) its depth in decoder_layers: every size reader goes through these."""
    from transformers import AutoConfig

    from shardtune.families import config_value, hidden_size, layer_count, set_layer_count, text_config

    gemma3 = AutoConfig.for_model("gemma3", text_config={"num_hidden_layers": 5, "hidden_size": 96})
    assert not hasattr(gemma3, "num_hidden_layers") and text_config(gemma3) is gemma3.text_config
    assert (layer_count(gemma3), hidden_size(gemma3)) == (5, 96)
    assert config_value(gemma3, "vocab_size") == gemma3.text_config.vocab_size
    pattern = gemma3.text_config.layer_types
    set_layer_count(gemma3, 2)
    assert gemma3.text_config.num_hidden_layers == 2 and gemma3.text_config.layer_types == pattern[:2]
    mbart = AutoConfig.for_model("mbart", encoder_layers=5, decoder_layers=3, d_model=64)
    assert text_config(mbart) is mbart and (layer_count(mbart), hidden_size(mbart)) == (3, 64)
    set_layer_count(mbart, 1)
    assert (mbart.decoder_layers, mbart.encoder_layers) == (1, 5)
    gpt2 = AutoConfig.for_model("gpt2", n_layer=4)
    set_layer_count(gpt2, 2)
    assert gpt2.n_layer == layer_count(gpt2) == 2


def test_a_heterogeneous_config_s_sizes_and_depth():
    """A per_layer_config (sizes some layers override): a size read gives the global value where
    transformers refuses the read; a new depth cuts or repeats the overrides with the layer types,
    so the config stays one transformers accepts."""
    from archs import tiny_config
    from transformers import AutoConfig

    from shardtune.families import config_value, set_layer_count

    moe = AutoConfig.for_model("qwen3_moe", num_hidden_layers=2, num_experts_per_tok=2,
                               per_layer_config={1: {"num_experts_per_tok": 1}})
    assert config_value(moe, "num_experts_per_tok") == 2
    gemma4 = tiny_config("gemma4_text")  # layer 1 (full attention) has twice the head_dim
    for depth, heads in ((4, [16, 32, 16, 32]), (1, [16])):
        set_layer_count(gemma4, depth)
        fields = {k: v for k, v in gemma4.to_dict().items() if k != "model_type"}
        rebuilt = AutoConfig.for_model("gemma4_text", **fields)  # saved and read back
        assert [rebuilt.per_layer_config[i].head_dim for i in range(depth)] == heads


def test_no_module_reads_a_size_field_but_through_families():
    """A size read straight off a config misses a multimodal config's text sub-config (the plan
    crash on Gemma 3 and Fuyu): every reader goes through families.config_value and its helpers."""
    import re
    from pathlib import Path

    fields = "|".join(("num_hidden_layers", "decoder_layers", "n_layer", "num_layers", "hidden_size", "n_embd",
                       "d_model", "vocab_size", "num_experts_per_tok", "max_position_embeddings",
                       "router_aux_loss_coef"))
    direct = re.compile(rf"(config|model\.config)\.({fields})\b|getattr\([\w.]+, \"({fields})\"")
    src = Path(__file__).resolve().parents[1] / "src" / "shardtune"
    found = [f"{path.relative_to(src)}:{n}" for path in src.rglob("*.py") if path.name != "families.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for m in direct.finditer(line) if line[:m.start()].count('"') % 2 == 0]  # not in a message
    assert not found, found
