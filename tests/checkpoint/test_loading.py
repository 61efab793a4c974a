"""A trained model loaded in one process (`checkpoint/loading.py`): a mergeable adapter folded
into its base gives the adapter model's logits, whatever it adapts."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY

PROBE = (torch.arange(40).reshape(2, 20) * 7) % 250


def adapter_folder(tmp_path, assets, targets: list[str]):
    """(adapter folder, the peft model's logits of PROBE): LoRA with random (non-zero) weights on
    `targets` of a tiny GPT-2 whose head is tied to its input embeddings."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY["gpt2"], "n_layer": 1, "n_embd": 32, "vocab_size": 300})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")  # the adapter names this folder
    assert base.config.tie_word_embeddings
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
        want = model.eval()(input_ids=PROBE).logits
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", want


@pytest.mark.parametrize("targets", [["c_attn", "wte"], ["c_attn"]])
def test_a_folded_adapter_is_the_adapter_model_even_on_tied_embeddings(tmp_path, assets, single_thread, targets):
    """A LoRA on input embeddings tied to the head changes the lookup only: folded (eval,
    generate) or merged (export --merge), the head keeps the base's weight (untied), and the
    config read without weights (every eval rank's skeleton) is the folded model's. Merged
    naively, the head moved too: logits off by tens."""
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
    untied = "wte" in targets
    assert config.tie_word_embeddings is merged.config.tie_word_embeddings is (not untied)
    assert load_model(str(folder), weights=False)[2].tie_word_embeddings is (not untied)
