"""The allocator's reserve (hardware.MEASURED_RESERVE) pinned against the measured H200 rows: the
planner's reserved memory is never more than 2 % under the measured one, nor more than 10 % over,
and each technique's share follows from its rows by the rule written in hardware.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune import hardware
from shardtune.hardware import EXTRA_RESERVE, MEASURED_RESERVE, PLAN_ACCURACY_GPU, STATES, overhead, reserve_share
from shardtune.plan.cost import Candidate, gpu_memory
from shardtune.plan.trace import StepTrace

MIB = 2 ** 20
# PLAN_ACCURACY_GPU, 2026-11-26, predicted again by today's planner (`bench/plan_accuracy.py --recorded`):
# (row, (checkpointing, peft method, offloading, step extra), predicted allocated, predicted transient,
# measured max_memory_reserved), MiB. The 8-bit optimizer row of the -h200-b run is left out: its worker
# measured the first step only (the state is made at its end); the -h200-c run measured it whole.
H200_ROWS = [
    ("gpt2-small, micro-batch 8", ("none", "none", False, ""), 6867, 4956, 7342),
    ("gpt2-small, full checkpointing, micro-batch 16", ("full", "none", False, ""), 3315, 1405, 3830),
    ("llama-100m, LoRA, micro-batch 8", ("none", "lora", False, ""), 3670, 3154, 3770),
    ("llama-1b, full checkpointing, micro-batch 4", ("full", "none", False, ""), 15855, 1310, 16428),
    ("llama-1b, selective checkpointing, micro-batch 4", ("selective", "none", False, ""), 18807, 4262, 19776),
    ("llama-1b, activation offloading, micro-batch 2", ("none", "none", True, ""), 15915, 1370, 18652),
    ("llama-1b, full checkpointing, fsdp.reduce_dtype=bf16", ("full", "none", False, ""), 15855, 1310, 16554),
    ("llama-1b, full checkpointing, float8=rowwise", ("full", "none", False, "float8"), 15855, 1310, 18846),
    ("llama-1b, full checkpointing, float8=tensorwise", ("full", "none", False, "float8"), 15806, 1261, 18846),
    ("llama-1b, full checkpointing, train.optimizer_state=8bit", ("full", "none", False, "8bit"), 10430, 1310, 13684),
]


def trace_of(allocated_mib: int, transient_mib: int) -> StepTrace:
    """A trace whose peak, with the cuBLAS workspace, is `allocated_mib`, of which all but
    `transient_mib` are sharded states (kept: no reserve beside them)."""
    states = (allocated_mib - transient_mib) * MIB
    live = {"sharded_params": states // 4, "gradients": states // 4, "optimizer_state": states - 2 * (states // 4)}
    live["activations"] = transient_mib * MIB - int(overhead("cublas_workspace"))
    return StepTrace({(1, "forward", "after blocks"): live}, 12, {"activations": 0}, {})


@pytest.mark.parametrize("row", H200_ROWS, ids=[r[0] for r in H200_ROWS])
def test_predicted_reserved_is_within_2_percent_under_and_10_over_the_measured(row):
    _, technique, allocated, transient, measured_reserved = row
    memory = gpu_memory(trace_of(allocated, transient), False, 1, technique)
    assert memory["allocated"] == allocated * MIB
    error = memory["reserved"] / (measured_reserved * MIB) - 1
    assert -0.02 <= error <= 0.10, (technique, error)
    assert memory["reserved"] >= memory["allocated"]


def test_each_share_is_its_rows_largest_rounded_up():
    """The rules, so a re-measured row changes the constants the way hardware.py says."""
    for technique, share in MEASURED_RESERVE.items():
        needed = [(reserved - allocated) / transient for _, t, allocated, transient, reserved in H200_ROWS
                  if t == (*technique, "")]
        assert needed, technique
        assert share.value == max(0.0, math.ceil(100 * max(needed)) / 100), technique
    for extra, share in EXTRA_RESERVE.items():
        needed = [(reserved - allocated - transient * reserve_share(*t[:3])) / allocated
                  for _, t, allocated, transient, reserved in H200_ROWS if t[3] == extra]
        assert needed, extra
        assert share.value == math.ceil(100 * max(needed)) / 100, extra
    assert "2026-11-26-h200" in PLAN_ACCURACY_GPU


def test_the_sharded_states_get_no_reserve():
    """A model ten times larger with the same step buffers reserves the same amount over allocated."""
    small = gpu_memory(trace_of(2_000, 1_000), False, 1, ("full", "none", False, ""))
    large = gpu_memory(trace_of(20_000, 1_000), False, 1, ("full", "none", False, ""))
    assert small["reserved"] - small["allocated"] == large["reserved"] - large["allocated"] > 0
    assert set(STATES) <= set(small["by_category"])


def test_a_candidate_names_its_technique_and_an_unmeasured_one_takes_the_widest_of_its_kind():
    from shardtune.config.schema import RunConfig

    cfg = RunConfig()
    cfg.peft.method = "lora"
    assert Candidate("full_shard", "bf16", 8, "none").technique(cfg)[:3] in MEASURED_RESERVE
    assert Candidate("full_shard", "bf16", 8, "none", cpu_offload=True).technique(cfg)[:3] not in MEASURED_RESERVE
    staying = max(o.value for k, o in MEASURED_RESERVE.items() if not k[2])
    offloading = max(o.value for k, o in MEASURED_RESERVE.items() if k[2])
    assert reserve_share("every_n", "none", False) == reserve_share() == staying
    assert reserve_share("full", "lora", True) == offloading > staying
    cfg.float8 = "rowwise"
    assert Candidate("full_shard", "bf16", 4, "full").technique(cfg) == ("full", "lora", False, "float8")
    assert Candidate("full_shard", "bf16", 4, "full", optimizer_state="4bit").technique(cfg)[3] == "float8+4bit"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["none", "full", "selective", "every_n"]), st.booleans(),
       st.sampled_from(["none", "rowwise", "tensorwise"]), st.sampled_from(["fp32", "bf16", "8bit", "4bit"]),
       st.integers(500, 80_000), st.integers(100, 40_000))
def test_a_step_extra_adds_to_the_reserve_and_never_takes_from_it(ac, offloading, f8, state, states, transient):
    """float8 and a low-bit optimizer state's step cache buffers of their own: a technique with one
    is never priced below the same technique without it, by at least the smallest measured extra's
    share of allocated (one never measured: the largest), and the extras of both add up."""
    trace = trace_of(states + transient, transient)
    extra = hardware.step_extra(f8, state)
    plain = gpu_memory(trace, False, 1, (ac, "none", offloading, ""))
    with_extra = gpu_memory(trace, False, 1, (ac, "none", offloading, extra))
    assert with_extra["allocated"] == plain["allocated"]
    added = with_extra["reserved"] - plain["reserved"]
    least = min(o.value for o in EXTRA_RESERVE.values())
    assert added >= int(plain["allocated"] * least * len([p for p in extra.split("+") if p])) - 1
    if "4bit" in extra:  # never measured: priced as the widest measured extra
        assert hardware.extra_reserve("4bit") == max(o.value for o in EXTRA_RESERVE.values())
    assert hardware.extra_reserve(extra) == pytest.approx(sum(hardware.extra_reserve(p) for p in extra.split("+") if p))


def test_the_rows_are_todays_planner_s_predictions():
    """The table holds predictions, which move when the planner does (they moved by 190 MiB on the
    small rows between the measurement and its re-prediction): GPT-2 small's two rows, traced again
    for the CUDA target, equal what the table says to 1 %. The 1B rows take too long to trace here:
    `bench/plan_accuracy.py --recorded` re-predicts all of them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from plan_accuracy import predict

    for name, technique, allocated, transient, _ in H200_ROWS[:2]:
        mb = 8 if technique[0] == "none" else 16
        spec = dict(shape="gpt2-small", ranks=1, sharding="full_shard", ac=technique[0], lora=False, mb=mb, seq=1024,
                    device="auto", precision="bf16", target="cuda", tiny=False, extra=())
        pred = predict(spec)
        assert pred["technique"] == technique, name
        assert pred["allocated"] / MIB == pytest.approx(allocated, rel=0.01), name
        assert pred["transient"] / MIB == pytest.approx(transient, rel=0.01), name
