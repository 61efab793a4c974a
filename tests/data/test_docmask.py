"""Document-masked packing and padding-free batches: a document inside a packed row computes
exactly what it computes alone, and padding-free batches give the padded batches' losses."""

from __future__ import annotations

import json
import re

import pytest

from conftest import TINY, losses, spread_alpaca, tiny_overrides
from shardtune.config.schema import DataConfig
from shardtune.data import batches as B
from shardtune.data import docmask as docmask
from shardtune.data import pipeline as D
from shardtune.errors import UserError

IGNORE = D.IGNORE_INDEX
MORE_TINY = {
    "mistral": {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128},
    "gpt_neox": {"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "max_position_embeddings": 128},
}


def tiny_model(arch: str, attn: str = "sdpa"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict({**TINY, **MORE_TINY}[arch])
    config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, bos_token_id=0, eos_token_id=1,
                                  attn_implementation=attn, **cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def docs_blocks():
    """Packed blocks (with and without the document mask) of 5 documents of random tokens (lengths 9, 23, 14, 6, 31)."""
    import datasets
    import torch

    from shardtune.data.packing import pack_rows

    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (9, 23, 14, 6, 31)]
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    return rows, pack_rows(ds, 64, "uint16", document_mask=True), pack_rows(ds, 64, "uint16", document_mask=False)


# representatives of each mechanism through packing and collate; every family of the table is
# checked (default attention) in tests/test_architectures.py
@pytest.mark.parametrize("arch", sorted({**TINY, **MORE_TINY}))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_document_in_a_packed_block_has_the_logits_it_has_alone(arch, attn, docs_blocks):
    import torch

    rows, masked, plain = docs_blocks
    model = tiny_model(arch, attn)
    batch = B.collate(masked, [0], torch.device("cpu"))
    assert batch["position_ids"][0].tolist() == [*range(9), *range(23), *range(14), *range(6), *range(12)]
    # no prediction across a document boundary: each document's first token has no label
    assert [i for i, t in enumerate(batch["labels"][0].tolist()) if t == IGNORE] == [9, 32, 46, 52]
    with torch.no_grad():
        packed = model(**docmask.model_inputs(model, batch)).logits[0]
        leaky = model(**docmask.model_inputs(model, B.collate(plain, [0], torch.device("cpu")))).logits[0]
        start = 0
        for row in rows[:4]:  # the fifth is cut by the block's end
            alone = model(input_ids=torch.tensor([row]), use_cache=False).logits[0]
            assert (packed[start:start + len(row)] - alone).abs().max() <= 1e-5, (arch, start)
            start += len(row)
        alone = model(input_ids=torch.tensor([rows[1]]), use_cache=False).logits[0]
        assert (leaky[9:32] - alone).abs().max() > 1e-3  # without the mask the second document sees the first


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_padding_free_batch_has_the_padded_batch_loss(arch):
    """Same token losses (and count) through the real step code, chunked head loss included."""
    import datasets
    import torch

    from shardtune.model import loss as loss_lib
    from shardtune.train.step import token_loss

    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (40, 7, 19, 60)]
    labels = [[IGNORE] * (len(x) // 2) + x[len(x) // 2:] for x in ids]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}).with_format("torch")
    model = tiny_model(arch)
    loss_lib.install(model, 16)
    cpu = torch.device("cpu")
    with torch.no_grad():
        padded = token_loss(model, B.collate(ds, [0, 1, 2, 3, -1], cpu, pad_id=0), accuracy=True)
        flat_batch = B.collate(ds, [0, 1, 2, 3, -1], cpu, pad_id=0, padding_free=True)
        flat = token_loss(model, flat_batch, accuracy=True)
    assert flat_batch["input_ids"].shape == (1, 40 + 7 + 19 + 60 + 40) and "attention_mask" not in flat_batch
    assert int(padded[1]) == int(flat[1]) == sum(len(x) - len(x) // 2 - (len(x) // 2 == 0) for x in ids)
    assert abs(float(padded[0]) - float(flat[0])) <= 1e-5 * float(padded[0]) and int(padded[2]) == int(flat[2])


def test_document_mask_defaults_by_format():
    assert not DataConfig(path="x").masks_documents
    assert DataConfig(path="x", document_mask=True).masks_documents
    assert DataConfig(path="x", format="instruct", packing=True).masks_documents
    assert not DataConfig(path="x", format="chat", packing=True, document_mask=False).masks_documents
    assert not DataConfig(path="x", format="instruct").masks_documents  # one example per row: nothing to mask
    assert DataConfig(path="x", format="instruct", padding_free=True).masks_documents


@pytest.mark.parametrize("model_config, words", [
    ({"model_type": "bloom", "n_layer": 1, "hidden_size": 32, "n_head": 2}, ["model type 'bloom'", "gpt2"]),
    ({**TINY["gpt2"], "attn_implementation": "flex_attention"}, ["'flex_attention'", "sdpa"]),
])
def test_model_that_cannot_keep_documents_apart_is_refused(model_config, words):
    from transformers import AutoConfig

    cfg = dict(model_config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with pytest.raises(UserError) as err:
        docmask.check(DataConfig(path="x", document_mask=True), hf_config)
    assert all(w in str(err.value) for w in words + ["data.document_mask=false"]), str(err.value)
    docmask.check(DataConfig(path="x"), hf_config)  # text without the mask: nothing to refuse


@pytest.mark.parametrize("model_type, extra, data, rows, refused", [
    ("falcon", {"alibi": True}, {"seq_len": 52}, 1, "Falcon's ALiBi (alibi=true)"),  # crashed on the 4-D mask
    ("llama4_text", {"floor_scale": 16}, {"seq_len": 52}, 1, "keep rows to 15 tokens (data.seq_len) or"),
    ("llama4_text", {"floor_scale": 64}, {"seq_len": 52}, 8, None),
    ("llama4_text", {"floor_scale": 64}, {"seq_len": 32, "padding_free": True}, 2, "(data.seq_len x micro-batch"),
    ("llama4_text", {"floor_scale": 16, "attn_temperature_tuning": False}, {"seq_len": 52}, 1, None),
    ("gpt_neo", {}, {"seq_len": 100, "padding_free": True}, 2, "keep rows to 128 tokens"),  # crashed
    ("gpt_neo", {}, {"seq_len": 64, "padding_free": True}, 2, None),
])
def test_a_setting_that_reads_the_row_not_the_document_is_refused(model_type, extra, data, rows, refused):
    """A model that reads a token's place in its row where alone it reads its place in the document
    (Falcon's ALiBi, Llama 4's query temperature past floor_scale, GPT-Neo's table of positions) is
    refused in one line where a row can be that long, and only there: on the longest row the run
    can make, a packed document computes what it computes alone, or the row is refused."""
    import torch
    from archs import packed_batch, packed_vs_alone, tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for name, value in {"attn_scale": 1.0, **extra}.items():  # Llama 4's temperature, made visible
        setattr(config, name, value)
    cfg = DataConfig(path="x", document_mask=True, **({"format": "instruct"} if "padding_free" in data else {}), **data)
    longest = cfg.seq_len * (rows if cfg.padding_free else 1)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (longest // 3, longest // 3)]
    docs.append(torch.randint(2, 250, (longest - 2 * (longest // 3),), generator=gen).tolist())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    try:
        worst = packed_vs_alone(model, packed_batch(docs), docs)
    except (ValueError, RuntimeError) as exc:  # the forward fails on such a row
        worst = exc
    if refused is None:
        docmask.check(cfg, config, rows)
        assert worst <= 1e-5, worst
        return
    with pytest.raises(UserError, match=re.escape(refused)) as err:
        docmask.check(cfg, config, rows)
    assert "\n" not in str(err.value) and str(err.value).endswith("=false"), str(err.value)
    assert isinstance(worst, Exception) or worst > 1e-3, worst


def test_bad_document_mask_input_is_one_line_before_any_data_work(assets, tmp_path, capfd):
    """Exit 2 with one line; the data path does not exist, so the error came before reading it."""
    from shardtune.cli.main import main

    bloom = json.dumps({"model_type": "bloom", "n_layer": 1, "hidden_size": 32, "n_head": 2})
    missing = str(tmp_path / "missing.jsonl")
    falcon_rw = json.dumps({"model_type": "falcon", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                            "alibi": True})
    for extra, words in [({"model.config": bloom, "data.document_mask": "true"}, "model type 'bloom'"),
                         ({"model.config": falcon_rw, "data.document_mask": "true"}, "Falcon's ALiBi"),
                         ({"data.padding_free": "true", "data.packing": "false"}, "data.format=text is packed"),
                         ({"data.padding_free": "true", "data.format": "chat", "data.packing": "true"},
                          "(or data.packing=false)"),
                         ({"data.padding_free": "true", "data.format": "instruct", "data.document_mask": "false"},
                          "needs the document mask")]:
        rc = main(["train", *tiny_overrides(assets, tmp_path / "run", **{**extra, "data.path": missing})])
        err = capfd.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert not (tmp_path / "run").exists()


def test_padding_free_training_matches_padded_training(assets, tmp_path, monkeypatch):
    """Alpaca-shaped examples of spread lengths: the same losses, step by step, and evaluation."""
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    path = spread_alpaca(tmp_path / "alpaca.jsonl")
    model = json.dumps({**TINY["llama"], "max_position_embeddings": 256})
    got, flat_rows = {}, []
    flatten = docmask.flatten
    monkeypatch.setattr(docmask, "flatten", lambda *a: flat_rows.append(1) or flatten(*a))
    for name, extra in [("padded", {}), ("padding_free", {"data.padding_free": "true"})]:
        overrides = tiny_overrides(assets, tmp_path / name, **{
            "model.config": model, "data.format": "instruct",
            "data.path": str(path), "data.seq_len": 256, "train.max_steps": 2, "train.micro_batch_size": 4,
            "data.val_size": 8, "eval.max_batches": 2, **extra})
        results = run(load_config(None, overrides, defaults={}), overwrite=True)
        got[name] = losses(tmp_path / name) + [results["last"]["eval_loss"]]
    assert max(abs(a - b) for a, b in zip(got["padded"], got["padding_free"], strict=True)) <= 1e-5, got
    assert len(flat_rows) == 2 * 2 + 2 * 2  # every micro-batch of 2 steps and of 2 evaluations went flat


def _has_flash_attn() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.mark.skipif(not _has_flash_attn(), reason="needs a CUDA GPU with flash-attn installed")
@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_flash_attention_varlen_keeps_documents_apart(arch, docs_blocks):
    """On CUDA, flash-attention's varlen kernel gets the document lengths (bf16 tolerance)."""
    import torch

    rows, masked, _ = docs_blocks
    model = tiny_model(arch, "flash_attention_2").to("cuda", torch.bfloat16)
    batch = B.collate(masked, [0, 0], torch.device("cuda"))  # two rows: the lengths span the micro-batch
    with torch.no_grad():
        packed = model(**docmask.model_inputs(model, batch)).logits.float()
        alone = model(input_ids=torch.tensor([rows[1]], device="cuda"), use_cache=False).logits[0].float()
    for row in packed:
        assert (row[9:32] - alone).abs().max() < 2e-2
