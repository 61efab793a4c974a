"""The planner never crashes on a candidate: a layout it cannot trace is dropped with its reason;
the recipes that once crashed it (padding-free batches, no recipe at all) are traced."""

from __future__ import annotations

import json

import pytest

from conftest import TINY
from shardtune.cli.common import recipe_and_defaults
from shardtune.config.load import load_config


def test_padding_free_batches_trace():
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.trace import trace_step

    cfg = load_config(None, [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "data.format=instruct",
                             "data.packing=false", "data.padding_free=true", "data.seq_len=32",
                             "train.micro_batch_size=2", "train.global_batch_size=2", "device=cpu"])
    trace = trace_step(cfg, load_hf_config(cfg.model), world_size=1)
    assert trace.peak()[1]["activations"] > 0


def test_quickstart_defaults_reach_load_config_as_a_mapping(monkeypatch):
    import shardtune.data.quickstart as quickstart

    tree = {"data": {"path": "x"}, "model": {"config": TINY["gpt2"]}}
    monkeypatch.setattr(quickstart, "quickstart_defaults", lambda overrides=(): (tree, "line"))
    recipe, overrides, defaults, used = recipe_and_defaults(None, ["train.lr=1e-3"])
    assert recipe is None and overrides == ["train.lr=1e-3"] and used == "line"
    assert load_config(recipe, overrides, defaults).data.path == "x"
    with pytest.raises(TypeError, match="mapping"):  # the slip that crashed `plan` without a recipe
        load_config(None, [], ({}, "line"))


def test_a_candidate_that_cannot_be_traced_is_a_reason(monkeypatch):
    """A trace failing for one layout (here: whenever activation checkpointing is off, and the whole
    trace of the winner) drops those candidates with one line each; the search still answers."""
    import shardtune.plan.search as search_mod
    import shardtune.plan.trace as trace_mod
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.cost import Candidate, Target
    from shardtune.plan.search import confirm, search

    real = trace_mod.trace_step
    whole = []

    def flaky(cfg, hf_config, world_size, local_world_size=None, layers=None, target="cpu"):
        if layers is None:
            whole.append(cfg)
            raise RuntimeError("fake tensors cannot follow this op\nsecond line")
        if cfg.activation_checkpointing == "none":
            raise NotImplementedError("no fake kernel for aten::mystery")
        return real(cfg, hf_config, world_size, local_world_size, layers, target)

    monkeypatch.setattr(trace_mod, "trace_step", flaky)
    # two layouts keep it quick: the lightest (traced first) and one whose trace fails
    monkeypatch.setattr(search_mod, "layouts", lambda cfg, target: [Candidate("full_shard", "fp32", 0, "full"),
                                                                    Candidate("full_shard", "fp32", 0, "none")])
    cfg = load_config(None, [f"model.config={json.dumps(TINY['gpt2'])}", "data.path=unused", "data.seq_len=32",
                             "train.micro_batch_size=1", "train.global_batch_size=2", "device=cpu"])
    hf_config = load_hf_config(cfg.model)
    target = Target(1, 1, 1 << 30, None)
    ranked = search(cfg, hf_config, target, say=lambda text: None)
    dropped = [e.why_not for e in ranked if e.candidate.checkpointing == "none"]
    failed = "cannot be traced: NotImplementedError: no fake kernel for aten::mystery"
    assert failed in dropped and all(w == failed or w.startswith("not traced: ") for w in dropped)
    assert any(e.fits for e in ranked)
    assert confirm([e for e in ranked if e.fits], cfg, hf_config, target) is None and whole
    assert any(e.why_not == "extrapolated fit, but the full trace cannot be traced: RuntimeError: fake tensors "
               "cannot follow this op" for e in ranked)
    assert search_mod.traced(lambda: 1) == 1
