"""A CPU rank keeps the pages a step frees (rank/host_memory.py): after a few steps, a step that
allocates and frees the same tensors faults no pages in. Measured in a fresh process, since the
allocator's setting is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import child_env

STEPS = r"""
import resource, sys, torch
from shardtune.rank.host_memory import keep_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step():  # a step's worth of tensors under glibc's 32 MiB ceiling, all freed at its end
    tensors = [torch.ones(6 * 2 ** 20) for _ in range(4)]  # 4 x 24 MiB
    del tensors

tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
counts = []
for _ in range(6):
    before = faults()
    step()
    counts.append(faults() - before)
print(tuned, *counts)
"""
PAGES_PER_STEP = 4 * 24 * 2 ** 20 // 4096


def faults_per_step(mode: str, **env: str) -> tuple[str, list[int]]:
    proc = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                          env=child_env(**env), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tuned, *counts = proc.stdout.split()
    return tuned, [int(c) for c in counts]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_tuned_rank_faults_no_pages_in_once_warm():
    tuned, counts = faults_per_step("tuned")
    if tuned == "False":
        pytest.skip("not glibc, or glibc tuned by this environment: the allocator is left as it is")
    _, default = faults_per_step("default")
    # the first steps map the heap; from the fourth on nothing more (glibc's default: about half of
    # a step's pages at every step)
    assert max(counts[3:]) < 0.02 * PAGES_PER_STEP, (counts, default)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_an_allocator_tuned_by_the_environment_is_left_as_it_is():
    """`sweep --mem-limit`'s trials ask glibc to return freed memory (sweep/trial.CAPPED_ENV), so
    that their cap binds on tensors: a rank must not undo that (it did: a 4-layer GPT-2 that fits at
    micro-batch 16 under the cap ran out of memory at 8)."""
    from shardtune.sweep.trial import CAPPED_ENV

    tuned, counts = faults_per_step("tuned", **CAPPED_ENV)
    assert tuned == "False"
    assert min(counts[3:]) > 0.25 * PAGES_PER_STEP, counts  # glibc returns the pages: they fault in again
    assert faults_per_step("tuned", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")[0] == "False"
