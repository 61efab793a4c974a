"""Every causal-LM architecture of the installed transformers (its own list,
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, read at collection), beyond the families table that
tests/test_architectures.py checks in depth, on a tiny config derived from the config class
(tests/archs.tiny_config), in one process.

Every type, every run: it builds in a few MB, takes one optimizer step (the head moves), and has
LoRA default targets without a target list. A fixed share of the types (SAMPLED: chosen by a hash
of the name, the same every run and every day) also takes the LoRA step (only adapters move),
keeps packed documents apart (or is refused document masking in one line, and really mixes them),
and is traced by `plan` on 2 fake ranks; SHARDTUNE_EVERY_ARCH_FULL=1 checks all of it on every
type (~6 min on 2 cores; bench/architectures.py gives the table)."""

from __future__ import annotations

import os
import zlib

import pytest
from archs import ARCHS, DOCS, optimizer_step, packed_batch, packed_vs_alone, run_config, tiny_config

# types this test cannot run in this transformers, and why
_DRAFTER = ("a speculative-decoding assistant: its forward needs the target model's inputs_embeds and "
            "shared_kv_states, not token ids")
SKIP = {
    "gemma4_assistant": _DRAFTER, "gemma4_unified_assistant": _DRAFTER,
    "gemma3n": "needs timm (not a shardtune dependency)",
    "musicgen": "transformers' own causal-LM class cannot be built from its config (no dropout): refused "
                "in one line (test_a_config_transformers_cannot_build_is_refused_in_one_line)",
    "musicgen_melody": "as musicgen",
}
MAX_PARAMS = 16_000_000  # 64 MB of fp32 weights
# types whose step `plan` cannot trace on fake tensors: its search drops their candidates with this
# one-line reason (plan.search.traced), never a crash; the test checks the reason is given
UNTRACEABLE = {"blt": "its patches end where the patcher's entropy passes a threshold (a boolean mask "
                      "index, nonzero): data-dependent shapes",
               **dict.fromkeys(("longcat_flash", "dbrx"),
                              "its experts loop over the experts hit (nonzero): data-dependent shapes"),
               "xmod": "its language adapters take each language's tokens by a boolean mask (nonzero): "
                       "data-dependent shapes",
               "reformer": "its reversible layers run their blocks inside an autograd Function of their own, "
                           "whose inputs torch's module tracker cannot hook (no grad_fn)",
               "jetmoe": "its experts split the tokens by counted sizes (tolist): data-dependent shapes",
               **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), "its sparse-attention indexer picks each "
                               "query's keys by nonzero: data-dependent shapes")}
SAMPLED_SHARE = 8  # one type in 8 (by the CRC-32 of its name) takes the expensive checks


def _others() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [pytest.param(t, marks=[pytest.mark.skip(reason=SKIP[t])] if t in SKIP else [])
            for t in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(ARCHS))]


def sampled(model_type: str) -> bool:
    """The type takes the expensive checks: a fixed hashed share, or all with SHARDTUNE_EVERY_ARCH_FULL=1."""
    return os.environ.get("SHARDTUNE_EVERY_ARCH_FULL") == "1" or zlib.crc32(model_type.encode()) % SAMPLED_SHARE == 0


def _check_document_mask(model_type, model, batch, rows, config) -> bool:
    """Packed documents equal alone where docmask allows the type; elsewhere they really differ
    (or the forward cannot take restarting positions) and the config is refused in one line."""
    from archs import check_flash_documents, check_long_rows

    from shardtune.config.schema import DataConfig
    from shardtune.data import docmask
    from shardtune.errors import UserError

    try:
        worst = packed_vs_alone(model, batch, rows)
    except Exception as exc:  # noqa: BLE001  no packed positions at all: must be refused
        worst = exc
    allowed = docmask.document_mask(model_type) is not None
    if allowed:
        assert not isinstance(worst, Exception) and worst <= 1e-5, (model_type, worst)
        docmask.check(DataConfig(path="x", document_mask=True, seq_len=sum(DOCS)), config)
        check_flash_documents(model_type, model, rows)
        check_long_rows(model_type, model)
        return True
    assert isinstance(worst, Exception) or worst > 1e-5, \
        f"{model_type}: packed documents match alone ({worst}): add it to families.PACKED_POSITIONS"
    with pytest.raises(UserError, match=f"model type '{model_type}' is not one") as refused:
        docmask.check(DataConfig(path="x", document_mask=True), config)
    assert "\n" not in str(refused.value)
    return False


@pytest.mark.parametrize("model_type", _others())
def test_every_causal_lm_trains_and_has_lora_targets(model_type, single_thread):
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.model.adapters import default_lora_targets

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    size = sum(p.numel() for p in model.parameters())
    assert size <= MAX_PARAMS, f"{model_type}: the tiny config has {size / 1e6:.1f} M parameters"
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in DOCS]  # below the special ids
    batch = packed_batch(rows)
    expensive = sampled(model_type)
    if not expensive or not _check_document_mask(model_type, model, batch, rows, config):
        batch = {k: v for k, v in batch.items() if k != "position_ids"}
    moved = optimizer_step(model_type, model, batch)
    assert any(p is model.get_output_embeddings().weight for n, p in model.named_parameters() if n in moved)
    assert default_lora_targets(model_type, model), f"{model_type}: no default LoRA targets"
    if expensive:
        _check_lora_step_and_plan(model_type, model, batch, config)


def _check_lora_step_and_plan(model_type, model, batch, config):
    """LoRA with no target list moves only its adapters; `plan` traces that run on 2 fake ranks."""
    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter
    from shardtune.plan.search import traced
    from shardtune.plan.trace import trace_step

    wrapped = add_adapter(model, PeftConfig(method="lora", r=4), seed=0)
    moved = optimizer_step(model_type, wrapped, batch)
    assert moved and all("lora_" in n for n in moved), (model_type, sorted(moved)[:4])
    cfg = run_config(model_type, "train.global_batch_size=2", "peft.method=lora", "peft.r=4",
                     f"data.seq_len={batch['input_ids'].size(1)}")  # the row it trained on
    trace = traced(lambda: trace_step(cfg, config, world_size=2))
    if model_type in UNTRACEABLE:
        assert isinstance(trace, str) and trace.startswith("cannot be traced: ") and "\n" not in trace, trace
        return
    assert not isinstance(trace, str), f"{model_type}: {trace}"
    assert 0 < trace.params["trainable"] < trace.params["total"] and trace.peak_bytes() > 0


def test_the_sample_is_fixed_and_a_real_share():
    types = [p.values[0] for p in _others() if not p.marks]
    chosen = [t for t in types if zlib.crc32(t.encode()) % SAMPLED_SHARE == 0]
    assert len(types) // (2 * SAMPLED_SHARE) <= len(chosen) <= 2 * len(types) // SAMPLED_SHARE, chosen


@pytest.mark.parametrize("model_type", ["mbart", "git", "gemma3", "mamba"])
def test_the_fsdp_block_is_the_language_model_s(model_type):
    """Where the table has no entry: the stack nearest the token embedding, of a class
    `_no_split_modules` names if any (not mBART's attention, not Git's or Gemma 3's vision
    layers, not Mamba's mixer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.distributed.fsdp import detect_block_class

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    expected = {"mbart": "MBartDecoderLayer", "git": "GitLayer", "gemma3": "Gemma3DecoderLayer",
                "mamba": "MambaBlock"}[model_type]
    assert detect_block_class(model).__name__ == expected


def test_a_config_transformers_cannot_build_is_refused_in_one_line():
    """MusicGen's causal-LM class (transformers' own mapping) cannot be built from MusicGen's config:
    refused before any work, in one line (transformers 5.17 refuses the config itself already)."""
    from shardtune.config.schema import ModelConfig
    from shardtune.errors import UserError
    from shardtune.model.hf import load_hf_config

    with pytest.raises(UserError, match="transformers cannot build model.config|model.config is refused by "
                                        "transformers") as exc:
        load_hf_config(ModelConfig(config={"model_type": "musicgen"}))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("language, words", [(None, " is not set"), ("xx_XX", "='xx_XX' is not one of its")])
def test_a_model_with_an_adapter_per_language_needs_the_language_set(language, words):
    """X-MOD's forward needs its inputs' language and shardtune passes no language ids: a config
    without a default language (or with one the model lacks) is refused in one line naming the fix."""
    from shardtune.errors import UserError
    from shardtune.model.hf import check_buildable

    config = tiny_config("xmod")
    config.default_language = language
    with pytest.raises(UserError, match=f"model.config.default_language{words}") as exc:
        check_buildable(config, False, "model.config")
    assert "\n" not in str(exc.value) and "set model.config.default_language=en_XX" in str(exc.value)
    check_buildable(tiny_config("xmod"), False, "model.config")  # the language set: it builds


def test_every_packed_positions_type_is_one_this_test_checks():
    """families.PACKED_POSITIONS allows document masking only where the logits test runs (a full
    run checks every entry): none in SKIP, and on the pinned transformers (constraints.txt) no entry
    it lacks (an older one, the GPU machine's 5.17, lacks the types added since)."""
    import transformers
    from packaging.version import Version
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from conftest import ROOT
    from shardtune.families import PACKED_POSITIONS

    pinned = next(line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line.startswith("transformers=="))
    if Version(transformers.__version__) >= Version(pinned):
        assert not PACKED_POSITIONS - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not PACKED_POSITIONS & set(SKIP), sorted(PACKED_POSITIONS & set(SKIP))
