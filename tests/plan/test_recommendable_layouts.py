"""Every layout the planner can recommend starts and takes a real step (CPU counterpart of the GPU
suite's rows): the candidates of `plan.menu.layouts` x `plan.search.variants` on 2 ranks, chosen so that
every pair of values of their dimensions (sharding, precision, checkpointing, activation
offloading, reduction dtype, optimizer state, CPU offload) runs together at least once, all in
one launch (tests/dist_harness.py), one optimizer step each."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT, child_env, losses, tiny_overrides
from shardtune.config.load import load_config
from shardtune.hardware import gpu_by_name
from shardtune.plan.cost import Candidate, Target
from shardtune.plan.menu import layouts
from shardtune.plan.search import variants

pytestmark = pytest.mark.multiproc
DIMS = ("sharding", "precision", "checkpointing", "activation_offload", "reduce_dtype", "optimizer_state",
        "cpu_offload")


def recommendable() -> list[Candidate]:
    """What the search can answer for an fp32 recipe on 2 GPUs with bf16 (A100) or without (T4)."""
    cfg = load_config(None, ["model.config={\"model_type\": \"gpt2\"}", "data.path=unused",
                             "train.micro_batch_size=2", "train.global_batch_size=8"])
    out = []
    for gpu in ("A100-80GB", "T4"):
        target = Target(2, 1, 1 << 40, gpu_by_name(gpu))
        out += [c for layout in layouts(cfg, target) for c in variants(layout, [2]) if c not in out]
    return out


def pairs(c: Candidate) -> set:
    values = [(d, getattr(c, d)) for d in DIMS]
    return set(itertools.combinations(values, 2))


def covering(menu: list[Candidate]) -> list[Candidate]:
    """Greedily, the candidate that runs the most value pairs not run yet, until all are."""
    left, chosen = set().union(*map(pairs, menu)), []
    while left:
        best = max(menu, key=lambda c: len(pairs(c) & left))
        chosen.append(best)
        left -= pairs(best)
    return chosen


def test_the_covering_set_runs_every_value_pair_of_the_menu():
    menu = recommendable()
    chosen = covering(menu)
    assert set().union(*map(pairs, chosen)) == set().union(*map(pairs, menu))
    for d in DIMS:  # the menu's own values, so a new one joins the run
        assert {getattr(c, d) for c in chosen} == {getattr(c, d) for c in menu}, d
    assert len(chosen) < len(menu) / 4


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_every_recommendable_layout_takes_a_step_on_two_ranks(assets, tmp_path):
    pytest.importorskip("torchao")
    chosen = covering(recommendable())
    quiet = {"train.max_steps": 1, "eval.at_start": "false", "eval.max_batches": 1, "save_final": "false"}
    jobs = {}
    for i, c in enumerate(chosen):
        settings = {k: str(v).lower() if isinstance(v, bool) else v for k, v in c.settings().items()}
        jobs[f"job{i}"] = tiny_overrides(assets, tmp_path / f"job{i}", **quiet, **settings)
    spec = {"result": str(tmp_path / "result.json"), "eager_torchao": True, "jobs": list(jobs.values())}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "tests/dist_harness.py", str(tmp_path / "spec.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for (name, _), c in zip(jobs.items(), chosen, strict=True):
        got = losses(tmp_path / name)
        assert len(got) == 1 and math.isfinite(got[0]), (c.label(), got)
