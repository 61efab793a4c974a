"""A trained mergeable adapter (LoRA, DoRA, IA3) folded into its base: a plain model, for eval,
generate and `export --merge`, and the config of that model read without weights, so that every
rank of eval builds what rank 0 folds."""

from __future__ import annotations

import copy
import re

import torch
import torch.nn as nn

from shardtune.model.adapters import matches


def _tied_pair(model):
    """(input embeddings, LM head) of a plain model whose two share one weight (tied), else None."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(getattr(emb, "base_layer", emb), "weight", None)  # a peft layer keeps the base's inside
    if head is None or weight is None or getattr(head, "weight", None) is not weight:
        return None
    return emb, head


def _untie(config) -> None:
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        cfg.tie_word_embeddings = False


def fold(peft_model):
    """A mergeable adapter (LoRA, DoRA, IA3) folded into its base: a plain model. An adapter on
    either of a tied pair (input embeddings, LM head: a peft-made adapter may adapt the head)
    changed that one only: the head gets its own copy of the base weight first (untied), else
    merging one would move the other too and the folded model would not be the one trained."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = peft_model.get_base_model()
    pair = _tied_pair(base)
    if pair is not None and any(isinstance(m, BaseTunerLayer) for m in pair):
        head = getattr(pair[1], "base_layer", pair[1])  # an adapted head's weight is its base layer's
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        _untie(base.config)
    return peft_model.merge_and_unload()


def folded_config(hf_config, targets, trust_remote_code: bool = False):
    """The config of the model `fold` gives for an adapter on `targets` (a list of names or peft's
    regular expression) over a base of `hf_config`: untied where they adapt either of a tied pair.
    Read from a skeleton on the meta device, so every rank builds what rank 0 folds."""
    from transformers import AutoModelForCausalLM

    if not targets or not getattr(hf_config.get_text_config(), "tie_word_embeddings", False):
        return hf_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    pair = _tied_pair(model)
    names = [n for n, m in model.named_modules() if pair and any(m is half for half in pair)]
    if not any(re.fullmatch(targets, n) if isinstance(targets, str) else matches(n, targets) for n in names):
        return hf_config
    config = copy.deepcopy(hf_config)
    _untie(config)
    return config
