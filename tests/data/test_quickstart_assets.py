"""The offline quickstart corpus + tokenizer: built locally, split cleanly, reused, race-safe."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardtune.data import quickstart as quickstart
from shardtune.data.quickstart import build_quickstart_assets, default_cache_dir

VOCAB = 512
MAX_DOCS = 600  # small and fast, still enough text to learn all 512 - 257 merges


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("qs-cache")
    return cache, build_quickstart_assets(cache, vocab_size=VOCAB, max_docs=MAX_DOCS)


def _texts(path):
    texts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        assert isinstance(row["text"], str) and row["text"].strip()
        texts.append(row["text"])
    return texts


def _tokenizer_mtimes(paths):
    return {p.name: p.stat().st_mtime_ns for p in Path(paths["tokenizer"]).iterdir()}


def test_assets_exist_and_splits_are_disjoint(built):
    _, paths = built
    assert set(paths) == {"train", "validation", "tokenizer"}
    for p in paths.values():
        assert os.path.isabs(p) and os.path.exists(p)
    train, validation = _texts(paths["train"]), _texts(paths["validation"])
    assert train and validation
    assert not set(train) & set(validation)
    assert len(train) + len(validation) == MAX_DOCS
    assert len(validation) == MAX_DOCS // 20  # every 20th document, starting with the first


def test_second_call_reuses(built):
    cache, paths = built
    before = _tokenizer_mtimes(paths)
    assert build_quickstart_assets(cache, vocab_size=VOCAB, max_docs=MAX_DOCS) == paths
    assert _tokenizer_mtimes(paths) == before


def test_tokenizer_loads_and_round_trips(built):
    from transformers import AutoTokenizer

    _, paths = built
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    assert len(tok) == VOCAB
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.model_max_length == 1024
    sample = "Return a new list , sorted:  x = {'naïve': 1}  # done — 😀\n\tnext line"
    ids = tok.encode(sample, add_special_tokens=False)
    assert tok.decode(ids) == sample


def test_losing_a_race_keeps_the_winner(built, monkeypatch):
    """If the target appears while we build, our copy is dropped and the winner's is untouched."""
    cache, paths = built
    before = _tokenizer_mtimes(paths)
    real, calls = quickstart._complete, []

    def first_check_misses(folder, wanted):
        calls.append(folder)
        return False if len(calls) == 1 else real(folder, wanted)

    monkeypatch.setattr(quickstart, "_complete", first_check_misses)
    assert build_quickstart_assets(cache, vocab_size=VOCAB, max_docs=MAX_DOCS) == paths
    assert _tokenizer_mtimes(paths) == before
    assert [p.name for p in cache.iterdir()] == [Path(paths["train"]).parent.name]  # no temp left


def test_concurrent_builds_agree_and_are_deterministic(built, tmp_path):
    """Two processes race on one cache; the result matches a build made in another process."""
    code = textwrap.dedent(f"""
        import json, sys
        from shardtune.data.quickstart import build_quickstart_assets
        print(json.dumps(build_quickstart_assets(sys.argv[1], vocab_size={VOCAB}, max_docs={MAX_DOCS})))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    results = [json.loads(o) for o in outs]
    assert results[0] == results[1]
    assert len(list(tmp_path.iterdir())) == 1  # the loser's temp folder was removed
    _, paths = built
    for key, name in (("train", ""), ("validation", ""), ("tokenizer", "tokenizer.json")):
        ours, theirs = Path(results[0][key], name), Path(paths[key], name)
        assert ours.read_bytes() == theirs.read_bytes(), key


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c" / "quickstart"
    monkeypatch.delenv("SHARDTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "shardtune" / "quickstart"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "shardtune" / "quickstart"


def test_the_corpus_does_not_depend_on_what_the_process_imported(monkeypatch):
    """A library that adds a documented method to a standard-library class (transformers does so to
    logging.Logger) or replaces one of its functions must not change the documents: the corpus of
    one Python is the same in every process (3 of 4,503 documents differed once torch and
    transformers were imported)."""
    import logging

    before = quickstart.collect_documents()

    def shouted(self, msg):
        """A method some library added to logging.Logger, with a docstring long enough to be a document."""

    monkeypatch.setattr(logging.Logger, "shout", shouted, raising=False)
    original = logging.getLogger

    def wrapped(name=None):  # a library's wrapper in its place
        return original(name)

    monkeypatch.setattr(logging, "getLogger", wrapped)
    after = quickstart.collect_documents()
    assert after == before
    assert not any("some library added" in d for d in after)
    assert any("Return a logger with the specified name" in d for d in after)  # logging.getLogger's own
