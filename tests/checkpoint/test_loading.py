"""A trained model loaded in one process (`checkpoint/loading.py`): a mergeable adapter folded
into its base gives the adapter model's logits, whatever it adapts."""

from __future__ import annotations

import pytest
import torch

from conftest import adapter_folder, adapter_probe

PROBE = adapter_probe()

@pytest.mark.parametrize("targets", [["c_attn", "wte"], ["c_attn"], ["c_attn", "lm_head"], ["wte", "lm_head"]])
def test_a_folded_adapter_is_the_adapter_model_even_on_tied_embeddings(tmp_path, assets, single_thread, targets):
    """A LoRA on input embeddings tied to the head changes the lookup only: folded (eval,
    generate) or merged (export --merge), the head keeps the base's weight (untied), and the
    config read without weights (every eval rank's skeleton) is the folded model's. Merged
    naively, the head moved too: logits off by tens. A peft-made adapter on the tied head (which
    shardtune's training refuses) moves the head only: merged naively the lookup moved too (logits
    off by ~27), and adapting both crashed on the head's weight."""
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint.export import merge_adapter_folder
    from shardtune.checkpoint.loading import load_model

    folder, want = adapter_folder(tmp_path, assets, targets)
    model, _, config, _ = load_model(str(folder))
    merge_adapter_folder(folder, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        for got in (model(input_ids=PROBE).logits, merged(input_ids=PROBE).logits):
            assert (got - want).abs().max() < 1e-4
    untied = targets != ["c_attn"]
    assert config.tie_word_embeddings is merged.config.tie_word_embeddings is (not untied)
    assert load_model(str(folder), weights=False)[2].tie_word_embeddings is (not untied)


def test_an_adapter_on_a_bf16_base_is_evaluated_as_trained(tmp_path, assets, single_thread):
    """A hub base is mostly stored in bf16, and a run trains on it read into fp32: eval and generate
    fold the adapter into that fp32 base, as they load a checkpoint of the run. Folded into the
    base as transformers loads it by default (bf16), part of the adapter's update was rounded away."""
    from shardtune.checkpoint.loading import load_model

    folder, want = adapter_folder(tmp_path, assets, ["c_attn"], torch.bfloat16)
    model = load_model(str(folder))[0]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert (model(input_ids=PROBE).logits - want).abs().max() < 1e-5
