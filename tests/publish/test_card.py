"""The model card's facts (publish/card.py) against what the run trained from."""

from __future__ import annotations

import json

import pytest

from conftest import TINY


@pytest.mark.parametrize("model, tag, source", [
    ({"model.config": json.dumps(TINY["gpt2"])}, "trained-from-scratch", "a randomly initialised gpt2 model"),
    ({"model.name_or_path": "openai-community/gpt2", "model.random_init": "true"}, "trained-from-scratch",
     "a randomly initialised model of openai-community/gpt2's config"),
    ({"model.name_or_path": "openai-community/gpt2"}, "fine-tuned", "openai-community/gpt2"),
])
def test_the_card_says_fresh_weights_are_trained_from_scratch(model, tag, source):
    """Fresh weights are what model.hf.load_source_model builds without name_or_path, or with
    random_init: the card tagged the first 'fine-tuned', and said the second was trained from
    the hub model whose config it only borrowed."""
    from shardtune.config.load import load_config
    from shardtune.publish.card import model_card

    cfg = load_config(None, [f"{k}={v}" for k, v in model.items()] + ["data.path=org/data"], defaults={})
    card = model_card(cfg.to_dict(), 3, None)
    header = card.split("---")[1]
    other, = {"fine-tuned", "trained-from-scratch"} - {tag}
    assert f"- {tag}" in header and f"- {other}" not in header
    assert f"trained from **{source}** on **org/data**" in card
    assert ("base_model:" in header) is (tag == "fine-tuned")
