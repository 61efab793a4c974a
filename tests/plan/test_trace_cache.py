"""The traced small copies are kept on disk per model shape, keyed by what changes a trace: a
second plan of the same shape traces nothing and answers the same; a key that changes the step
traces again, one plan/keys.py calls irrelevant does not; a damaged file is traced again."""

from __future__ import annotations

import dataclasses
import json

from conftest import TINY
from shardtune.config.load import load_config
from shardtune.plan.trace_cache import TraceCache


def tiny(*extra: str):
    return load_config(None, [f"model.config={json.dumps(TINY['gpt2'])}", "data.path=unused", "data.seq_len=32",
                              "train.micro_batch_size=1", "train.global_batch_size=4", "device=cpu", *extra])


def test_a_trace_is_read_back_as_traced_and_keyed_by_what_changes_it(tmp_path):
    from shardtune.model.hf import load_hf_config

    cache = TraceCache(tmp_path)
    cfg = tiny()
    hf_config = load_hf_config(cfg.model)
    traced = cache.trace(cfg, hf_config, 2, layers=2, target="cuda")
    again = cache.trace(tiny("train.lr=0.1", "output_dir=elsewhere"), hf_config, 2, layers=2, target="cuda")
    assert (cache.misses, cache.hits) == (1, 1) and dataclasses.asdict(again) == dataclasses.asdict(traced)
    key = cache.key(cfg, hf_config, 2, 2, 2, "cuda")
    for other in [cache.key(tiny("activation_checkpointing=full"), hf_config, 2, 2, 2, "cuda"),
                  cache.key(cfg, hf_config, 4, 4, 2, "cuda"), cache.key(cfg, hf_config, 2, 2, 3, "cuda"),
                  cache.key(cfg, hf_config, 2, 2, 2, "cpu")]:
        assert other != key
    (tmp_path / f"{key}.json").write_text("{not json")
    assert dataclasses.asdict(cache.trace(cfg, hf_config, 2, layers=2, target="cuda")) == dataclasses.asdict(traced)
    assert cache.misses == 2


def test_a_second_search_of_the_same_shape_traces_nothing_and_answers_the_same(tmp_path):
    from shardtune.hardware import gpu_by_name
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.cost import Target
    from shardtune.plan.search import search

    cfg = tiny()
    hf_config = load_hf_config(cfg.model)
    first, second = TraceCache(tmp_path), TraceCache(tmp_path)
    said: dict = {first: [], second: []}
    ranked = [search(cfg, hf_config, Target(1, 1, gpu.memory_bytes, gpu), said[cache].append, cache)
              for gpu, cache in ((gpu_by_name("T4"), first), (gpu_by_name("T4"), second))]
    assert first.misses > 0 and first.hits == 0 and second.misses == 0 and second.hits == first.misses
    # "tracing LAYOUT" is said where a layout is traced, not where its traces are read back
    assert [line for line in said[first] if line.startswith("tracing ")]
    assert not [line for line in said[second] if line.startswith("tracing ")]
    assert [(e.candidate, e.fits, e.tokens_per_s) for e in ranked[0]] == \
        [(e.candidate, e.fits, e.tokens_per_s) for e in ranked[1]]
