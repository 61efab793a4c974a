"""Combinations of features on tiny models (Hypothesis): a train config that the check accepts
trains (exit 0, finite losses), and one it cannot train is refused by the check (`check.run`) in
one line, exit 2, before anything is built, never a traceback mid-build or mid-step.

Over the data formats (text, instruct, chat) with packing, document masks, padding-free batches,
length grouping and prompt losses; the peft methods and their inits, scalings and targets;
freezing; activation checkpointing and offloading; FSDP's sharding, wrapping, offload and
prefetch; precisions; loss chunks; optimizer state; eval and checkpoint cadence; epochs and
steps; on_nan; several model families. Each example is 2 in-process steps (~1-3 s) or a refusal.

The suite runs a few examples with a fixed seed (derandomized); for a longer search:
    SHARDTUNE_FUZZ_EXAMPLES=400 python -m pytest -q -p no:cacheprovider tests/e2e/test_combos.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
from archs import arch_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY, losses, main_in_process, tiny_overrides

EXAMPLES = int(os.environ.get("SHARDTUNE_FUZZ_EXAMPLES", "0"))
FAMILIES = ["gpt2", "llama", "opt", "mistral", "qwen2", "gemma", "phi", "falcon", "gpt_neox"]


def _formats():
    """tests/data/test_formats.py's rows (the real datasets' column names) and chat template."""
    path = Path(__file__).parents[1] / "data" / "test_formats.py"
    spec = importlib.util.spec_from_file_location("combo_formats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(assets, tmp_path_factory):
    """One folder per format: the quickstart corpus (text), Alpaca rows (instruct), chat rows."""
    formats, root = _formats(), tmp_path_factory.mktemp("combo-data")
    rows = {"instruct": formats.ALPACA * 20, "chat": [formats.chat_row(i, 1 + i % 3) for i in range(80)]}
    for name, kind in rows.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kind))
    return {"text": str(Path(assets["train"]).parent), "instruct": str(root / "instruct"), "chat": str(root / "chat"),
            "chat_template": formats.CHAT_TEMPLATE}


def maybe(key: str, values) -> st.SearchStrategy[dict]:
    """{key: one of values} or nothing (the default)."""
    return st.one_of(st.just({}), st.sampled_from(values).map(lambda v: {key: v}))


def merged(*parts) -> st.SearchStrategy[dict]:
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})


DATA = st.one_of(
    st.just({"format": "text"}),
    merged(st.fixed_dictionaries({"format": st.sampled_from(["instruct", "chat"])}),
           *(maybe(f"data.{key}", ["true", "false"])
             for key in ("packing", "document_mask", "padding_free", "group_by_length", "train_on_inputs"))))
PEFT = st.one_of(
    st.just({}),
    merged(st.fixed_dictionaries({"peft.method": st.sampled_from(["lora", "dora"])}),
           maybe("peft.init", ["gaussian", "pissa", "olora"]), maybe("peft.rslora", ["true"]),
           maybe("peft.lora_plus_ratio", [4, 16]), maybe("peft.r", [1, 3]),
           maybe("peft.target_modules", ["[lm_head]", "[q_proj,v_proj]", "[c_attn]", "[fc1]", "[embed_tokens]",
                                         "[wte,c_attn]", "[all-linear]"])),
    st.fixed_dictionaries({"peft.method": st.just("ia3")}),
    st.fixed_dictionaries({"peft.method": st.sampled_from(["prefix_tuning", "prompt_tuning"]),
                           "peft.num_virtual_tokens": st.sampled_from([1, 4])}),
    st.fixed_dictionaries({"peft.method": st.just("adaption_prompt"), "peft.adapter_len": st.sampled_from([1, 3])}),
    maybe("freeze.trainable_blocks", [0, 1]), st.just({"freeze.head_only": "true"}),
    st.just({"freeze.embeddings": "true"}))
LAYOUT = merged(
    maybe("activation_checkpointing", ["full", "selective", "every_n"]),
    maybe("activation_checkpointing_every", [1, 3]),
    maybe("activation_offload", ["true"]), maybe("fsdp.sharding", ["shard_grad_op", "no_shard"]),
    st.one_of(st.just({}), st.sampled_from([1, 1000]).map(lambda n: {"fsdp.wrap": "size", "fsdp.min_num_params": n})),
    maybe("fsdp.cpu_offload", ["true"]), maybe("fsdp.forward_prefetch", [1, 3]),
    maybe("fsdp.backward_prefetch", [0, 2]),
    maybe("precision", ["bf16", "fp16"]), maybe("loss_chunk_tokens", [0, 1, 7, 10 ** 9]))
RUN = merged(
    st.sampled_from([(1, 1), (2, 2), (1, 2), (3, 6)]).map(
        lambda b: {"train.micro_batch_size": b[0], "train.global_batch_size": b[1]}),
    st.sampled_from([{"train.max_steps": 2}, {"train.max_steps": 0, "train.epochs": 0.02},
                     {"train.max_steps": 0, "train.epochs": 1.5, "data.end_idx": 12}]),
    maybe("eval.every_steps", [1]), maybe("eval.micro_batch_size", [1, 5]), maybe("checkpoint.every_steps", [1]),
    maybe("checkpoint.at_epoch_end", ["true"]), maybe("checkpoint.keep_last", [1]),
    maybe("checkpoint.hf_format", ["true"]),
    maybe("checkpoint.sharded_final", ["true"]), maybe("eval.at_start", ["false"]), maybe("log.watch", ["all"]),
    maybe("train.warmup_steps", [1, 5]), maybe("train.lr_schedule", ["linear", "constant"]),
    maybe("on_nan", ["skip"]), maybe("train.max_grad_norm", [0]))


def overrides(data: dict, assets, out: Path, family: str, fmt: dict, rest: dict) -> list[str]:
    fmt = dict(fmt)
    kind = fmt.pop("format")
    model = TINY[family] if family in TINY else arch_config(family)
    extra = {"model.config": json.dumps(model), "data.path": data[kind], "train.max_steps": 2,
             "eval.max_batches": 2, "device": "cpu", **fmt, **rest}
    if kind != "text":  # the Alpaca prompt alone is ~90 tokens of the 300-token vocabulary
        extra.update({"data.format": kind, "data.seq_len": 128, "data.val_size": 4})
    if kind == "chat":
        extra["data.chat_template"] = json.dumps(data["chat_template"])
    return tiny_overrides(assets, out, **extra)


def train_and_check(words: list[str], out: Path, monkeypatch) -> int:
    """`shardtune train words` in-process: exit 0 with finite losses, or 2 with one line that
    the check (check.run.check_run) gave, nothing built; anything else fails with what happened."""
    import shardtune.check.run as check

    checked, real = [], check.check_run
    monkeypatch.setattr(check, "check_run", lambda *a, **kw: checked.append(real(*a, **kw)) or checked[-1])
    rc, text = main_in_process(["train", *words, "--overwrite"])
    lines = [line for line in text.splitlines() if line.strip()]
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{words!r}:\n{text[-3000:]}"
        assert not checked, f"refused after the check passed, mid-build: {lines[0]}\n{words!r}"
        return rc
    assert rc == 0 and "Traceback" not in text, f"rc={rc} for {words!r}:\n{text[-3000:]}"
    got = losses(out)
    assert got and all(math.isfinite(x) for x in got), f"losses {got} for {words!r}"
    return rc


@settings(max_examples=max(12, EXAMPLES), derandomize=True, deadline=None, database=None, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(family=st.sampled_from(FAMILIES), fmt=DATA, peft=PEFT, layout=LAYOUT, run=RUN)
def test_a_checked_combination_trains_or_the_check_refuses_it(data, assets, tmp_path, monkeypatch, single_thread,
                                                             family, fmt, peft, layout, run):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        train_and_check(overrides(data, assets, out, family, fmt, {**peft, **layout, **run}), out, mp)


# What the search found, each kept as it was first seen: it trains now, or the check refuses it.
FOUND = {
    # peft's IA3 vectors live in a ParameterDict, which size-based wrapping made an FSDP unit of its
    # own: never called, so never gathered (a DTensor met a tensor in the IA3 layer's forward)
    "ia3_size_wrap": ("gpt2", {"format": "instruct"}, {"peft.method": "ia3", "fsdp.wrap": "size",
                                                       "fsdp.min_num_params": 1}, 0),
    # and lora_A a unit of its own, whose weight's dtype LoRA's forward reads: fp32 (sharded) in forward,
    # bf16 (gathered) when the checkpointed block was recomputed (torch's CheckpointError in backward)
    "lora_units_under_checkpointing": ("gpt2", {"format": "text"}, {
        "peft.method": "lora", "activation_checkpointing": "full", "fsdp.wrap": "size", "fsdp.min_num_params": 1,
        "precision": "bf16"}, 0),
    # transformers renames GPT-NeoX's weights on save: refused once the model was built
    "hf_format_of_renamed_weights": ("gpt_neox", {"format": "text"}, {"checkpoint.every_steps": 1,
                                                                      "checkpoint.hf_format": "true"}, 2),
    # an adapter on GPT-2's LM head, tied to the input embeddings: transformers' tie_weights raised a
    # KeyError when the weights were broadcast
    "dora_on_tied_head": ("gpt2", {"format": "chat"}, {"peft.method": "dora", "peft.target_modules": "[lm_head]"}, 2),
    # refused mid-build, after the data was tokenized: now by the check, on the meta skeleton
    "missing_target": ("llama", {"format": "text"}, {"peft.method": "dora", "peft.target_modules": '[".*"]'}, 2),
    "trainable_blocks_above_depth": ("mistral", {"format": "text"}, {"freeze.trainable_blocks": 5}, 2),
    "unknown_block_class": ("gpt2", {"format": "text"}, {"fsdp.block_class": "Nope"}, 2),
    # FSDP units inside a selectively checkpointed block: their recomputed gathers are ops the
    # cache of the block's forward does not hold (torch raised in the first backward)
    "selective_units_in_blocks": ("gpt2", {"format": "text"}, {"activation_checkpointing": "selective",
                                                               "fsdp.wrap": "size", "fsdp.min_num_params": 1}, 2),
    "selective_block_units": ("gpt2", {"format": "text"}, {"activation_checkpointing": "selective",
                                                           "fsdp.wrap": "size", "fsdp.min_num_params": 49984}, 0),
}


@pytest.mark.parametrize("name", FOUND)
def test_what_the_search_found(data, assets, tmp_path, monkeypatch, single_thread, name):
    family, fmt, rest, code = FOUND[name]
    out = tmp_path / "run"
    assert train_and_check(overrides(data, assets, out, family, fmt, rest), out, monkeypatch) == code
