"""Every causal-LM architecture of the installed transformers (its own list,
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, read at collection), beyond the families table that
tests/test_architectures.py checks in depth: on a tiny config derived from the config class
(tests/archs.tiny_config), in one process, it builds in a few MB, takes one optimizer step,
takes LoRA with no target list (one step), keeps packed documents apart (or refuses document
masking in one line, and really mixes them), and `plan` traces a LoRA run on 2 fake ranks.

All of it costs ~2-15 s a type on 2 loaded cores (~330 s for the 129 runnable types with only
the trace sharded), far over the suite's budget: a run checks the types of one of PLAN_SHARDS
hashed shards, a different shard each day, so every type is checked over a week of runs
(SHARDTUNE_EVERY_ARCH_FULL=1: all of them now).
The families table's 33 types are not repeated here: tests/test_architectures.py checks them."""

from __future__ import annotations

import datetime
import os
import zlib

import pytest
from archs import ARCHS, tiny_config
from test_architectures import DOCS, _batch, _run_config

# types this test cannot run in this transformers, and why
_DEFAULTS = "the config class's own defaults do not build (a real checkpoint sets the field)"
_PER_LAYER = "sizes live in per-layer configs (per_layer_config), which the tiny rule does not shrink"
SKIP = {
    "bailing_hybrid": "its linear attention's head sizes are not derived by the tiny rule (shape error)",
    "blt": "byte-latent model: its sizes are in encoder/decoder/global sub-configs (190 M parameters)",
    "cohere_compass_text": _DEFAULTS, "dbrx": _DEFAULTS, "lfm2_moe": _DEFAULTS, "nemotron": _DEFAULTS,
    "qwen4_exp": _DEFAULTS, "qwen4_exp_text": _DEFAULTS, "gemma3n_text": _DEFAULTS, "gemma4_assistant": _DEFAULTS,
    "dots3_note": _PER_LAYER, "dots3_note_text": _PER_LAYER, "gemma4": _PER_LAYER, "gemma4_text": _PER_LAYER,
    "gemma4_unified": _PER_LAYER, "gemma4_unified_text": _PER_LAYER,
    "deepseek_v4": "its compressed attention needs sizes the tiny rule does not derive (shape error)",
    "jetmoe": "its experts' sizes are not derived by the tiny rule (split error)",
    "mamba2": "needs hidden_size x expand = num_heads x head_dim, a constraint the tiny rule does not solve",
    "reformer": "axial position embeddings whose factors must sum to hidden_size",
    "xlm": "its embedding sizes escape the tiny rule (102 M parameters)",
    "gemma3n": "needs timm (not a shardtune dependency)",
    "musicgen": "AutoModelForCausalLM builds MusicgenForCausalLM from the composite config: no num_hidden_layers",
    "musicgen_melody": "as musicgen: the causal-LM class needs the decoder sub-config",
    "fuyu": "multimodal wrapper without num_hidden_layers: plan's trace cannot set its depth",
    "mbart": "plan's trace fails in FSDP2 on its shared embeddings (no _unsharded_param)",
    "gemma3": "plan's trace sets num_hidden_layers, which Gemma3Config (multimodal) does not have",
    "git": "the LoRA step: its default-target forward leaves no grad_fn (vision-text model)",
    "kimi_linear": "its linear attention's top-k exceeds the tiny sizes (index out of range)",
    "xmod": "needs a language id per input (set_default_language): special inputs",
}
MAX_PARAMS = 16_000_000  # 64 MB of fp32 weights
PLAN_SHARDS = 7


def _others() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def marks(t):
        if t in SKIP:
            return [pytest.mark.skip(reason=SKIP[t])]
        return [] if _today(t) else [pytest.mark.skip(reason="another day's shard (SHARDTUNE_EVERY_ARCH_FULL=1)")]

    return [pytest.param(t, marks=marks(t)) for t in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(ARCHS))]


def _today(model_type: str) -> bool:
    """The type's hashed shard is today's (SHARDTUNE_EVERY_ARCH_FULL=1: every type's)."""
    if os.environ.get("SHARDTUNE_EVERY_ARCH_FULL") == "1":
        return True
    return zlib.crc32(model_type.encode()) % PLAN_SHARDS == datetime.date.today().toordinal() % PLAN_SHARDS


def _check_document_mask(model_type, model, batch, rows, config) -> bool:
    """Packed documents equal alone where docmask allows the type; elsewhere they really differ
    (or the forward cannot take restarting positions) and the config is refused in one line."""
    import torch

    from shardtune.config.schema import DataConfig
    from shardtune.data import docmask
    from shardtune.errors import UserError

    try:
        with torch.no_grad():
            packed = model(**docmask.model_inputs(model, batch)).logits[0]
            start, worst = 0, 0.0
            for row in rows:
                alone = model(input_ids=torch.tensor([row]), use_cache=False).logits[0]
                worst = max(worst, float((packed[start:start + len(row)] - alone).abs().max()))
                start += len(row)
    except Exception as exc:  # noqa: BLE001  no packed positions at all: must be refused
        worst = exc
    allowed = docmask.document_mask(model_type) is not None
    if allowed:
        assert not isinstance(worst, Exception) and worst <= 1e-5, (model_type, worst)
        docmask.check(DataConfig(path="x", document_mask=True), config)
        return True
    assert isinstance(worst, Exception) or worst > 1e-5, \
        f"{model_type}: packed documents match alone ({worst}): add it to families.PACKED_POSITIONS"
    with pytest.raises(UserError, match=f"model type '{model_type}' is not one") as refused:
        docmask.check(DataConfig(path="x", document_mask=True), config)
    assert "\n" not in str(refused.value)
    return False


def _step(model_type, model, batch):
    """One optimizer step through shardtune's train_step; returns the parameters it moved."""
    import torch

    from shardtune.distributed.process_group import Dist
    from shardtune.train.optim import build_optimizer
    from shardtune.train.step import train_step

    cfg = _run_config(model_type, "train.global_batch_size=1", "train.lr=1e-2")
    model.train()
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = train_step(model, optimizer, None, [batch], cfg, Dist(0, 1, 1, torch.device("cpu")), labels_vary=True)
    assert torch.isfinite(out.loss_sum) and torch.isfinite(out.grad_norm), model_type
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


@pytest.mark.parametrize("model_type", _others())
def test_every_causal_lm_trains_takes_lora_and_plans(model_type):
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_lora, default_lora_targets

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    size = sum(p.numel() for p in model.parameters())
    assert size <= MAX_PARAMS, f"{model_type}: the tiny config has {size / 1e6:.1f} M parameters"
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in DOCS]  # below the special ids
    batch = _batch(rows)
    if not _check_document_mask(model_type, model, batch, rows, config):
        batch = {k: v for k, v in batch.items() if k != "position_ids"}

    moved = _step(model_type, model, batch)
    assert any(p is model.get_output_embeddings().weight for n, p in model.named_parameters() if n in moved)

    targets = default_lora_targets(model_type, model)
    assert targets, f"{model_type}: no default LoRA targets"
    wrapped = add_lora(model, PeftConfig(method="lora", r=4), model_type, seed=0)
    assert any("lora_" in n for n, _ in wrapped.named_parameters())
    moved = _step(model_type, wrapped, batch)
    assert moved and all("lora_" in n for n in moved), (model_type, sorted(moved)[:4])
    from shardtune.plan.trace import trace_step

    cfg = _run_config(model_type, "train.global_batch_size=2", "peft.method=lora", "peft.r=4")
    trace = trace_step(cfg, config, world_size=2)
    assert 0 < trace.params["trainable"] < trace.params["total"] and trace.peak_bytes() > 0
