"""Packing, splitting, slicing, and which blocks each rank sees."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtune.config.schema import DataConfig
from shardtune.data import batches as B
from shardtune.data import pipeline as D
from shardtune.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["tokenizer"])


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def test_pack_joins_documents_with_eos_and_cuts_fixed_blocks(tmp_path, tokenizer):
    import datasets

    texts = [f"document number {i} says hello world" for i in range(30)]
    docs = datasets.Dataset.from_dict({"text": texts})
    packed = D.pack(docs, tokenizer, "text", seq_len=16)
    stream = []
    for t in texts:
        stream += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(packed) == len(stream) // 16
    assert packed[:]["input_ids"].shape == (len(packed), 16)
    assert packed[:]["input_ids"].flatten().tolist() == stream[:len(packed) * 16]


def test_own_validation_split_is_used(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", [f"train doc {i} " * 5 for i in range(50)])
    write_jsonl(tmp_path / "validation.jsonl", [f"val doc {i} " * 5 for i in range(7)])
    cfg = DataConfig(path=str(tmp_path), seq_len=8)
    train, val = D.split_documents(cfg, D.load_documents(cfg))
    assert len(train) == 50 and len(val) == 7
    assert val[0]["text"].startswith("val doc 0")


def test_preparation_reads_each_file_once_for_its_checks(tmp_path, tokenizer, monkeypatch):
    """The check of a text file is a pass over all of it: naming a split's files in messages
    listed them through local_files again, and every file was read two or three times more."""
    from shardtune.data import files

    write_jsonl(tmp_path / "train.jsonl", [f"train doc {i} " * 5 for i in range(50)])
    write_jsonl(tmp_path / "validation.jsonl", [f"val doc {i} " * 5 for i in range(7)])
    checked = []
    real = files._check_text_file
    monkeypatch.setattr(files, "_check_text_file", lambda path, *args, **kw: (checked.append(path.name),
                                                                             real(path, *args, **kw)))
    train, val = D.prepare(DataConfig(path=str(tmp_path), seq_len=8), tokenizer)
    assert len(train) and len(val) and sorted(checked) == ["train.jsonl", "validation.jsonl"]


def test_runs_of_any_seed_hold_out_the_same_documents(assets, tmp_path):
    """train.seed shuffles and initialises; it chose the hold-out too, so a sweep over seeds ranked
    losses measured on different validation documents (and trained on different ones)."""
    from conftest import make_trainer

    held = []
    for seed in (1, 2):
        trainer = make_trainer(assets, tmp_path / f"s{seed}", arch="gpt2",  # one file: the hold-out validates
                               **{"train.seed": seed, "data.path": assets["train"], "data.val_size": 0.2})
        held.append(([row["input_ids"].tolist() for row in trainer.val_ds], len(trainer.train_ds)))
        trainer.close()
    assert held[0] == held[1] and held[0][0]


def test_holdout_is_seeded_disjoint_and_slicing_applies_to_the_rest(tmp_path):
    write_jsonl(tmp_path / "all.jsonl", [f"doc {i}" for i in range(100)])
    cfg = DataConfig(path=str(tmp_path / "all.jsonl"), val_size=0.1, start_idx=10, end_idx=40)
    splits = D.load_documents(cfg)
    train, val = D.split_documents(cfg, splits)
    train2, val2 = D.split_documents(cfg, splits)
    assert len(val) == 10 and len(train) == 30
    assert val["text"] == val2["text"] and train["text"] == train2["text"]
    assert not set(train["text"]) & set(val["text"])
    rest = [t for t in splits["train"]["text"] if t not in set(val["text"])]
    assert train["text"] == rest[10:40]
    # val_size as a count
    cfg_count = DataConfig(path=str(tmp_path / "all.jsonl"), val_size=5)
    assert len(D.split_documents(cfg_count, splits)[1]) == 5


def test_prepare_returns_packed_torch_datasets(tmp_path, tokenizer, assets):
    cfg = DataConfig(path=assets["train"].rsplit("/", 1)[0], seq_len=32)
    train, val = D.prepare(cfg, tokenizer)
    assert train[0]["input_ids"].shape == (32,) and val is not None and len(val) > 0


@pytest.mark.parametrize("val_words", [2, 40])
def test_a_validation_split_shorter_than_one_sequence_is_said_not_dropped_silently(tmp_path, tokenizer, capsys,
                                                                                  val_words):
    """The run goes on without validation, as before, but says so in one line naming the split."""
    write_jsonl(tmp_path / "train.jsonl", [f"train doc {i} " * 5 for i in range(50)])
    write_jsonl(tmp_path / "validation.jsonl", ["val " * val_words])
    train, val = D.prepare(DataConfig(path=str(tmp_path), seq_len=16), tokenizer)
    said = [line for line in capsys.readouterr().err.splitlines() if "validat" in line]
    assert len(train) > 0 and (val is None) == (val_words == 2)
    assert said == ([f"warning: the validation split of {str(tmp_path)!r} (validation.jsonl) has fewer tokens than "
                     "one sequence of data.seq_len=16; this run validates nothing (add validation documents, or "
                     "lower data.seq_len)"] if val is None else []), said


@pytest.mark.parametrize(("docs", "val_size", "held"), [(9, 0.05, 0), (10, 0.05, 0), (30, 0.05, 2), (9, 1, 1),
                                                        (9, 0, 0)])
def test_a_val_size_that_holds_out_nothing_is_said(tmp_path, tokenizer, capsys, docs, val_size, held):
    """The default 5 % of a small corpus (9 books) rounds to no document: the run validated nothing without
    a word. Said in one line, as a validation split too short for one sequence is; data.val_size=0 asks
    for none."""
    write_jsonl(tmp_path / "train.jsonl", [f"a long document {i} " * 40 for i in range(docs)])
    _, val = D.prepare(DataConfig(path=str(tmp_path), seq_len=16, val_size=val_size), tokenizer)
    said = [line for line in capsys.readouterr().err.splitlines() if "validat" in line]
    assert (val is not None) == bool(held)
    assert said == ([f"warning: data.val_size=0.05 of the {docs} training documents of {str(tmp_path)!r} holds out "
                     "none; this run validates nothing (hold out a count: data.val_size=1)"]
                    if val_size and not held else []), said


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_see_distinct_parts_of_the_same_global_batches(world):
    n, global_batch, micro = 100, 8, 2
    reference = B.BatchPlan(n, global_batch, micro, 1, 0, seed=7)
    for epoch, step in [(0, 0), (0, 5), (1, 3)]:
        expected = [i for mb in reference.micro_batches(epoch, step) for i in mb]
        per_rank = [B.BatchPlan(n, global_batch, micro, world, r, seed=7).micro_batches(epoch, step)
                    for r in range(world)]
        seen = [i for rank in per_rank for mb in rank for i in mb]
        assert len(seen) == len(set(seen)) == global_batch  # distinct across ranks
        assert sorted(seen) == sorted(expected)  # the same global batch whatever the world size
        assert all(len(mb) == micro and len(rank) == global_batch // (micro * world)
                   for rank in per_rank for mb in rank)
    plan = B.BatchPlan(n, global_batch, micro, 1, 0, seed=7)
    assert plan.order(0).tolist() != plan.order(1).tolist()  # reshuffled every epoch
    assert plan.steps_per_epoch == n // global_batch


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), global_batch=st.integers(1, 64), seed=st.integers(0, 2**31), epoch=st.integers(0, 3),
       lengths_seed=st.integers(0, 2**31))
def test_group_by_length_reorders_an_epoch_but_trains_the_plain_orders_samples(n, global_batch, seed, epoch,
                                                                               lengths_seed):
    """The samples past an epoch's last whole batch are the plain order's, at random: grouping cut them
    after sorting, the shortest of the dataset (of its last chunk) left out of every epoch."""
    import random

    global_batch = min(global_batch, n)
    lengths = [random.Random(lengths_seed + i).randint(1, 50) for i in range(n)]
    plain = B.BatchPlan(n, global_batch, global_batch, 1, 0, seed)
    grouped = B.BatchPlan(n, global_batch, global_batch, 1, 0, seed, lengths=lengths)
    usable = plain.steps_per_epoch * global_batch
    assert sorted(grouped.order(epoch).tolist()) == list(range(n))
    assert sorted(grouped.order(epoch)[:usable].tolist()) == sorted(plain.order(epoch)[:usable].tolist())


def test_eval_batches_cover_everything_once_with_equal_counts_per_rank():
    n, micro, world = 11, 2, 3
    per_rank = [B.eval_batches(n, micro, world, r) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    real = sorted(i for b in per_rank for mb in b for i in mb if i >= 0)
    assert real == list(range(n))
    capped = [B.eval_batches(n, micro, world, r, max_batches=4) for r in range(world)]
    assert sorted(i for b in capped for mb in b for i in mb if i >= 0) == list(range(8))
    assert [i for mb in B.eval_batches(n, micro, 1, 0, max_batches=4) for i in mb] == list(range(8))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 50), micro=st.sampled_from([1, 2, 3, 7, 64, 10 ** 4]),
       world=st.integers(1, 5), max_batches=st.sampled_from([0, 1, 3, 10 ** 6]))
def test_eval_batches_hold_no_more_rows_than_the_data_needs(n, micro, world, max_batches):
    """A micro-batch far above the data (eval --micro-batch-size 1e11) built that many blank rows and
    ran out of memory: each rank's batches hold at most its share of the sequences, every sequence
    of the capped set exactly once, and every rank as many batches as the others."""
    per_rank = [B.eval_batches(n, micro, world, r, max_batches) for r in range(world)]
    wanted = min(n, max_batches * micro) if max_batches else n
    assert len({len(b) for b in per_rank}) == 1
    assert sorted(i for b in per_rank for mb in b for i in mb if i >= 0) == list(range(wanted))
    assert all(len(mb) <= max(1, -(-wanted // world)) for b in per_rank for mb in b)


def test_collate_masks_padding_rows(tokenizer, assets):
    import torch

    cfg = DataConfig(path=assets["train"].rsplit("/", 1)[0], seq_len=16)
    train, _ = D.prepare(cfg, tokenizer)
    batch = B.collate(train, [0, -1], torch.device("cpu"))
    assert torch.equal(batch["labels"][0], batch["input_ids"][0])
    assert (batch["labels"][1] == D.IGNORE_INDEX).all()


def test_too_few_sequences_for_one_global_batch_is_a_user_error():
    with pytest.raises(UserError, match="global_batch_size"):
        B.BatchPlan(3, 8, 2, 1, 0, seed=0)


def test_blank_documents_add_no_tokens(tokenizer):
    import datasets

    with_blanks = datasets.Dataset.from_dict({"text": ["alpha beta", "", "   ", "gamma delta"] * 20})
    without = datasets.Dataset.from_dict({"text": ["alpha beta", "gamma delta"] * 20})
    a = D.pack(with_blanks, tokenizer, "text", seq_len=8)[:]["input_ids"]
    b = D.pack(without, tokenizer, "text", seq_len=8)[:]["input_ids"]
    assert a.tolist() == b.tolist()


def test_the_prefetcher_hands_over_each_step_in_order_across_epochs():
    """Assembled one step ahead in a thread, each step's micro-batches are exactly those of
    the plan, from a resumed step on, over an epoch boundary, and never out of order."""
    import datasets
    import torch

    ds = datasets.Dataset.from_dict({"input_ids": [[i] * 4 for i in range(12)]}).with_format("torch")
    plan = B.BatchPlan(12, global_batch=4, micro_batch=2, world_size=1, rank=0, seed=3)
    cpu = torch.device("cpu")

    def assemble(step):
        return [B.collate(ds, mb, cpu) for mb in plan.micro_batches(*divmod(step, plan.steps_per_epoch))]

    prefetcher = B.Prefetcher(assemble, cpu, first_step=2, end_step=7)  # 3 steps an epoch
    try:
        for step in range(2, 7):
            got, waited = prefetcher.take(step)
            want = assemble(step)
            assert waited >= 0 and len(got) == len(want) == 2
            assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want, strict=True) for k in w)
        assert prefetcher.pending is None  # nothing assembled past the end
    finally:
        prefetcher.close()
    prefetcher = B.Prefetcher(assemble, cpu, first_step=0, end_step=3)
    with pytest.raises(AssertionError, match="prefetched step 0, asked for 1"):
        prefetcher.take(1)
    prefetcher.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.integers(1, 12), words=st.integers(1, 40), val_size=st.one_of(st.integers(0, 20), st.floats(0, 0.99)),
       start=st.integers(0, 4), seq_len=st.sampled_from([8, 64]), batch=st.integers(1, 16))
def test_a_training_split_too_small_names_what_made_it_small(tokenizer, monkeypatch, docs, words, val_size, start,
                                                             seq_len, batch):
    """Whatever the sizes, a refused training split names the hold-out (data.val_size) and the
    slice where they took documents away, not only the batch size or seq_len it ran out for."""
    import datasets

    texts = [" ".join(["alpha beta gamma"] * words)] * docs
    monkeypatch.setattr(D, "load_documents", lambda cfg: {"train": datasets.Dataset.from_dict({"text": texts})})
    cfg = DataConfig(path="corpus", seq_len=seq_len, val_size=val_size, start_idx=start)
    held = int(val_size) if val_size >= 1 else int(round(docs * val_size))
    try:
        train, _ = D.prepare(cfg, tokenizer, global_batch=batch)
    except UserError as exc:
        line = str(exc)
        assert "\n" not in line
        if held:
            assert "data.val_size" in line, line
        if start and held < docs:  # else refused before the slice
            assert "slice" in line, line
        return
    assert held < docs and len(train) >= batch


def test_val_size_above_the_data_is_refused_as_such(tokenizer, tmp_path):
    """The arxiv recipe (val_size: 2000) on a small file: the refusal names data.val_size."""
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "abstracts.jsonl", ["a short abstract"] * 50)), val_size=2000)
    with pytest.raises(UserError, match=r"data.val_size=2000 holds out 2000 document\(s\).* only 50; lower"):
        D.prepare(cfg, tokenizer)


@pytest.mark.parametrize("fmt", ["text", "instruct"])
def test_ranks_that_prepared_different_data_are_refused_alike(tmp_path, tokenizer, monkeypatch, fmt):
    """Each rank prepares its own data: a node whose copy of data.path differs (more documents, another
    first one) trained its ranks on other samples than the plan's, or hung where the counts of steps
    differ. Each rank now compares its data (counts, lengths, a hash of three sequences) with rank 0's,
    and all refuse alike; the same data passes."""
    import torch
    import torch.distributed as tdist

    from shardtune.distributed.process_group import Dist

    rows = [{"instruction": f"say {i}", "output": f"number {i} is here " * 3, "text": f"doc {i} " * 6}
            for i in range(40)]
    edited = [rows[1], *rows[1:]]  # the first document another's, of the same length
    extra = {"template": "{instruction}: "} if fmt == "instruct" else {}  # a prompt shorter than seq_len

    def rank_of(rows, name, rank0=None) -> dict:
        """Rank 0 (`rank0` None) or rank 1 beside a rank 0 that sent `rank0`, having prepared `rows`:
        what it sends (every rank gets the same gathered list, so one rank's refusal is all of theirs)."""
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = DataConfig(path=str(tmp_path / name), seq_len=64, val_size=0, format=fmt, **extra)
        train, val = D.prepare(cfg, tokenizer)
        sent = {}

        def all_gather_object(seen, value):
            seen[:] = [rank0 or value, sent.update(value) or value]
        monkeypatch.setattr(tdist, "all_gather_object", all_gather_object)
        D.same_on_every_rank(Dist(int(rank0 is not None), 2, 2, torch.device("cpu")),
                             {"training": train, "validation": val})
        return sent

    ours = rank_of(rows, "ours")
    for name, theirs, refused in (("same", rows, None), ("longer", [*rows, *rows[:10]], "training sequences"),
                                  ("edited", edited, "training tokens (a hash)")):
        try:
            rank_of(theirs, name, ours)
        except UserError as exc:
            assert refused and str(exc).startswith(f"the ranks of this job read different data: {refused} "), exc
        else:
            assert refused is None, name
