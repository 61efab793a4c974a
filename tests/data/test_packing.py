"""Out-of-core packing gives exactly the blocks of the plain in-memory recipe (tokenize every
non-blank document, append EOS, concatenate, cut into seq_len blocks, drop the tail), in the same
order through BatchPlan, from any number of worker processes, and is cached."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import pipeline as D
from shardtune.data.packing import PackedBlocks

IGNORE = D.IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["tokenizer"])


def reference_blocks(texts, tokenizer, seq_len):
    stream = []
    for t in texts:
        if t and t.strip():
            stream += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    usable = len(stream) // seq_len * seq_len
    return [stream[i:i + seq_len] for i in range(0, usable, seq_len)]


def test_blocks_and_their_order_equal_the_in_memory_recipe_on_the_fixture(assets, tokenizer):
    import torch

    cfg = DataConfig(path=str(Path(assets["train"]).parent), seq_len=48)
    train, val = D.prepare(cfg, tokenizer, seed=0)
    train_docs, val_docs = D.split_documents(cfg, D.load_documents(cfg), seed=0)
    want = reference_blocks(train_docs["text"], tokenizer, 48)
    assert isinstance(train, PackedBlocks) and len(train) == len(want) > 100
    assert train[:]["input_ids"].tolist() == want and set(train[3]) == {"input_ids"}
    assert val[:]["input_ids"].tolist() == reference_blocks(val_docs["text"], tokenizer, 48)
    # BatchPlan is unchanged, so every rank's micro-batches hold the same blocks as before
    plan = D.BatchPlan(len(train), 8, 2, 2, 1, seed=5)
    for mb in plan.micro_batches(1, 3):
        batch = D.collate(train, mb, torch.device("cpu"))
        assert batch["input_ids"].tolist() == [want[i] for i in mb] == batch["labels"].tolist()
        assert set(batch) == {"input_ids", "labels"}


def test_worker_processes_and_a_second_run_give_the_same_blocks_from_one_cache(tmp_path, tokenizer):
    texts = [f"document {i} " + "word " * (i % 37) for i in range(2500)] + ["", "  "]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = DataConfig(path=str(path), seq_len=32, val_size=0)
    one, _ = D.prepare(cfg, tokenizer, seed=0)
    stamp = os.stat(one.folder / "input_ids.bin").st_mtime_ns
    assert one[:]["input_ids"].tolist() == reference_blocks(texts, tokenizer, 32)
    again, _ = D.prepare(DataConfig(path=str(path), seq_len=16, val_size=0), tokenizer, seed=0)
    assert again.folder == one.folder and os.stat(again.folder / "input_ids.bin").st_mtime_ns == stamp  # cached
    assert again[:]["input_ids"].tolist() == reference_blocks(texts, tokenizer, 16)
    workers, _ = D.prepare(DataConfig(path=str(path), seq_len=32, val_size=0, num_proc=2, end_idx=2400),
                           tokenizer, seed=0)
    assert workers.folder != one.folder  # other documents, another key
    assert workers[:]["input_ids"].tolist() == reference_blocks(texts[:2400], tokenizer, 32)
    assert list(one.folder.parent.glob("*.tmp-*")) == []  # nothing half-written left behind


def test_packed_instruct_blocks_equal_concatenated_examples(tmp_path, tokenizer):
    from test_formats import ALPACA

    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ALPACA * 10))
    base = dict(path=str(path), format="instruct", seq_len=128, val_size=0)
    rows, _ = D.prepare(DataConfig(**base), tokenizer, seed=0)
    ids = [t for r in rows for t in r["input_ids"].tolist()]
    labels = [t for r in rows for t in r["labels"].tolist()]
    n = len(ids) // 128
    offsets, at = set(), 0
    for r in rows:
        offsets.add(at)
        at += len(r["input_ids"])
    inner = {o for o in offsets if o % 128 and o < n * 128}  # examples starting inside a block
    for mask in (False, True):
        packed, _ = D.prepare(DataConfig(**base, packing=True, document_mask=mask), tokenizer, seed=0)
        assert len(packed) == n and packed[:]["input_ids"].flatten().tolist() == ids[:n * 128]
        dropped = inner if mask else set()  # no label across an example boundary
        assert packed[:]["labels"].flatten().tolist() == [IGNORE if i in dropped else t
                                                          for i, t in enumerate(labels[:n * 128])]
        if mask:
            restarts = {i for i, p in enumerate(packed[:]["position_ids"].flatten().tolist()) if p == 0}
            assert restarts == inner | set(range(0, n * 128, 128))
