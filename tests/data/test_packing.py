"""Out-of-core packing gives exactly the blocks of the plain in-memory recipe (tokenize every
non-blank document, append EOS, concatenate, cut into seq_len blocks, drop the tail), in the same
order through BatchPlan, from any number of worker processes, and is cached."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import llama_tokenizer
from shardtune.config.schema import DataConfig
from shardtune.data import batches as B
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
    train, val = D.prepare(cfg, tokenizer)
    train_docs, val_docs = D.split_documents(cfg, D.load_documents(cfg))
    want = reference_blocks(train_docs["text"], tokenizer, 48)
    assert isinstance(train, PackedBlocks) and len(train) == len(want) > 100
    assert train[:]["input_ids"].tolist() == want and set(train[3]) == {"input_ids"}
    assert val[:]["input_ids"].tolist() == reference_blocks(val_docs["text"], tokenizer, 48)
    # BatchPlan is unchanged, so every rank's micro-batches hold the same blocks as before
    plan = B.BatchPlan(len(train), 8, 2, 2, 1, seed=5)
    for mb in plan.micro_batches(1, 3):
        batch = B.collate(train, mb, torch.device("cpu"))
        assert batch["input_ids"].tolist() == [want[i] for i in mb] == batch["labels"].tolist()
        assert set(batch) == {"input_ids", "labels"}


def test_worker_processes_and_a_second_run_give_the_same_blocks_from_one_cache(tmp_path, tokenizer):
    texts = [f"document {i} " + "word " * (i % 37) for i in range(2500)] + ["", "  "]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = DataConfig(path=str(path), seq_len=32, val_size=0)
    one, _ = D.prepare(cfg, tokenizer)
    stamp = os.stat(one.folder / "input_ids.bin").st_mtime_ns
    assert one[:]["input_ids"].tolist() == reference_blocks(texts, tokenizer, 32)
    again, _ = D.prepare(DataConfig(path=str(path), seq_len=16, val_size=0), tokenizer)
    assert again.folder == one.folder and os.stat(again.folder / "input_ids.bin").st_mtime_ns == stamp  # cached
    assert again[:]["input_ids"].tolist() == reference_blocks(texts, tokenizer, 16)
    workers, _ = D.prepare(DataConfig(path=str(path), seq_len=32, val_size=0, num_proc=2, end_idx=2400),
                           tokenizer)
    assert workers.folder != one.folder  # other documents, another key
    assert workers[:]["input_ids"].tolist() == reference_blocks(texts[:2400], tokenizer, 32)
    assert list(one.folder.parent.glob("*.tmp-*")) == []  # nothing half-written left behind


def test_packed_instruct_blocks_equal_concatenated_examples(tmp_path, tokenizer):
    from test_formats import ALPACA

    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ALPACA * 10))
    base = dict(path=str(path), format="instruct", seq_len=128, val_size=0)
    rows, _ = D.prepare(DataConfig(**base), tokenizer)
    ids = [t for r in rows for t in r["input_ids"].tolist()]
    labels = [t for r in rows for t in r["labels"].tolist()]
    n = len(ids) // 128
    offsets, at = set(), 0
    for r in rows:
        offsets.add(at)
        at += len(r["input_ids"])
    inner = {o for o in offsets if o % 128 and o < n * 128}  # examples starting inside a block
    for mask in (False, True):
        packed, _ = D.prepare(DataConfig(**base, packing=True, document_mask=mask), tokenizer)
        assert len(packed) == n and packed[:]["input_ids"].flatten().tolist() == ids[:n * 128]
        dropped = inner if mask else set()  # no label across an example boundary
        assert packed[:]["labels"].flatten().tolist() == [IGNORE if i in dropped else t
                                                          for i, t in enumerate(labels[:n * 128])]
        if mask:
            restarts = {i for i, p in enumerate(packed[:]["position_ids"].flatten().tolist()) if p == 0}
            assert restarts == inner | set(range(0, n * 128, 128))



DOCS = st.lists(st.lists(st.sampled_from(["The", "capital", "Paris", "café", "🙂", "x=1;", "\n", " ", "日本語", "<s>",
                                          "</s>", "<|endoftext|>"]), max_size=6).map(" ".join), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=DOCS, kind=st.sampled_from(["byte-level", "llama", "llama add_eos"]), seq_len=st.integers(1, 9))
def test_every_document_reads_as_its_tokenizer_reads_it_then_eos(tokenizer, texts, kind, seq_len):
    """A text block holds each document as the tokenizer alone makes it (transformers'
    `tokenizer(doc)`: a llama-style BOS first, as instruct prompts have) and then EOS: Llama's,
    Mistral's, Gemma's documents had no BOS, and the model read every one as the middle of a text.
    A document that writes its own <s> or </s> (Llama-2 data laid out by hand) gets no second one."""
    import datasets

    tok = {"byte-level": tokenizer, "llama": llama_tokenizer(), "llama add_eos": llama_tokenizer(add_eos=True)}[kind]
    bos, eos, stream = tok.bos_token_id, tok.eos_token_id, []
    for t in texts:
        if t.strip():
            plain = tok(t, add_special_tokens=False)["input_ids"]
            doc = ([bos] if kind != "byte-level" and plain[:1] != [bos] else []) + plain
            doc += [eos] if doc[-1:] != [eos] else []
            if not {"<s>", "</s>", "<|endoftext|>"} & set(t.split()):  # transformers' own reading of it
                assert doc == tok(t)["input_ids"] + [eos] * (kind != "llama add_eos")
            stream += doc
    blocks = D.pack(datasets.Dataset.from_list([{"text": t} for t in texts]), tok, "text", seq_len)
    assert blocks[:]["input_ids"].flatten().tolist() == stream[:len(stream) // seq_len * seq_len]


KILLED_MID_TOKENIZATION = r"""
import sys, time
from transformers import AutoTokenizer
from shardtune.config.schema import DataConfig
from shardtune.data import packing, pipeline

def stuck(*args):
    print("tokenizing", flush=True)
    time.sleep(120)

packing.encode = stuck
docs = pipeline.load_documents(DataConfig(path=sys.argv[1]))["train"]
pipeline.pack(docs, AutoTokenizer.from_pretrained(sys.argv[2]), "text", 32)
"""


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A datasets cache of this test's own, for this process and the ones it starts."""
    import datasets

    cache = tmp_path / "hf-datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def test_a_killed_tokenization_leaves_a_folder_the_next_preparation_removes(assets, tokenizer, own_cache):
    """SIGTERM (or SIGKILL) runs no cleanup: the half-written folder stays, unlocked, until the next
    preparation in that cache; a folder whose writer is alive stays."""
    import signal
    import subprocess
    import sys

    from conftest import child_env
    from shardtune.data import packing

    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_TOKENIZATION, assets["train"], assets["tokenizer"]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert proc.stdout.readline() == "tokenizing\n", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    docs = D.load_documents(DataConfig(path=assets["train"]))["train"]
    cache = Path(docs.cache_files[0]["filename"]).parent
    [left] = cache.glob("shardtune-tokens-*.tmp-*")  # what the issue saw
    live, lock = packing._locked_tmp(cache, "shardtune-tokens-other.tmp-")  # another process, still writing
    try:
        blocks = D.pack(docs, tokenizer, "text", 32)
        assert len(blocks) > 0 and blocks.folder.parent == cache and not left.exists() and live.is_dir()
        assert list(cache.glob("shardtune-tokens-*.tmp-*")) == [live]
    finally:
        os.close(lock)


def test_an_interrupted_tokenization_removes_its_folder_at_once(assets, tokenizer, own_cache, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) or an error mid-tokenization: the temporary folder goes at once."""
    from shardtune.data import packing

    def interrupted(*args):
        raise KeyboardInterrupt

    docs = D.load_documents(DataConfig(path=assets["train"]))["train"]
    monkeypatch.setattr(packing, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        D.pack(docs, tokenizer, "text", 32)
    assert list(Path(docs.cache_files[0]["filename"]).parent.glob("shardtune-tokens-*")) == []
