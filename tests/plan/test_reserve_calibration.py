"""The allocator's reserve (hardware.MEASURED_RESERVE) pinned against the measured H100 rows: the
planner's reserved memory is never more than 2 % under the measured one, nor more than 10 % over."""

from __future__ import annotations

import pytest

from shardtune.hardware import MEASURED_RESERVE, PLAN_ACCURACY_H100, overhead, reserve_share
from shardtune.plan.cost import Candidate, gpu_memory
from shardtune.plan.trace import StepTrace

MIB = 2 ** 20
# PLAN_ACCURACY_H100, 2026-11-25 (main at ee768fd): (checkpointing, peft method, offloading) ->
# (the planner's predicted allocated, measured max_memory_allocated, measured max_memory_reserved), MiB
H100_ROWS = {
    ("none", "none", False): (7243, 6989, 7832),  # gpt2-small, full_shard, micro-batch 8
    ("full", "none", False): (3583, 3480, 4282),  # gpt2-small, full checkpointing, micro-batch 16
    ("none", "lora", False): (4189, 3904, 4004),  # llama-100m, LoRA, micro-batch 8
}


def trace_allocating(mib: int) -> StepTrace:
    """A trace whose peak, with the cuBLAS workspace, is `mib` allocated."""
    live = mib * MIB - int(overhead("cublas_workspace"))
    return StepTrace({(0, "backward", "middle blocks"): {"activations": live}}, 12, {"activations": 0}, {})


@pytest.mark.parametrize("technique", sorted(H100_ROWS))
def test_predicted_reserved_is_within_2_percent_under_and_10_over_the_measured(technique):
    predicted_allocated, _, measured_reserved = H100_ROWS[technique]
    memory = gpu_memory(trace_allocating(predicted_allocated), False, 1, technique)
    assert memory["allocated"] == predicted_allocated * MIB
    error = memory["reserved"] / (measured_reserved * MIB) - 1
    assert -0.02 <= error <= 0.10, (technique, error)
    assert memory["reserved"] >= memory["allocated"]


def test_every_measured_technique_has_its_row_and_a_candidate_names_it():
    assert sorted(MEASURED_RESERVE) == sorted(H100_ROWS) and "2026-11-25-h100" in PLAN_ACCURACY_H100
    from shardtune.config.schema import RunConfig

    cfg = RunConfig()
    cfg.peft.method = "lora"
    assert Candidate("full_shard", "bf16", 8, "none").technique(cfg) in MEASURED_RESERVE
    assert Candidate("full_shard", "bf16", 8, "none", cpu_offload=True).technique(cfg) not in MEASURED_RESERVE


def test_an_unmeasured_technique_takes_the_top_of_the_measured_spread():
    top = max(o.value for o in MEASURED_RESERVE.values())
    assert reserve_share("selective", "none", False) == reserve_share() == top
    assert top == pytest.approx(max(res / alloc - 1 for alloc, _, res in H100_ROWS.values()), abs=0.01)
