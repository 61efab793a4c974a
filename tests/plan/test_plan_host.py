"""Host RAM is a limit of every answer: each GPU of the table has a default host budget (from an
instance type that carries it), used when --host-mem is not given, and printed in the answer."""

from __future__ import annotations

import re

import pytest

from shardtune.config.load import load_config
from shardtune.hardware import GIB, GPUS
from shardtune.plan.cost import Candidate
from shardtune.plan.report import PlanRequest, target_from_request


def test_every_gpu_has_a_host_budget_with_its_source():
    for gpu in GPUS:
        # "<provider> <instance type>: N x <card>, <memory>": the figure divided by N is the default
        found = re.search(r": (\d+) x .+, ([\d,]+) (GiB|GB|TiB)", gpu.host_source)
        assert found, gpu
        if found.group(3) == "GiB":
            assert gpu.host_gib == int(found.group(2).replace(",", "")) // int(found.group(1)), gpu
        assert 16 <= gpu.host_gib <= 512, gpu


def test_the_default_host_budget_is_per_node_and_given_wins():
    v100 = target_from_request(PlanRequest(gpus=4, gpu="V100-16GB"))
    assert v100.host_bytes == 4 * 61 * GIB and "AWS p3.8xlarge" in v100.host_source
    given = target_from_request(PlanRequest(gpus=4, gpu="V100-16GB", host_mem="1TiB"))
    assert given.host_bytes == 2 ** 40 and given.host_source == "--host-mem"
    assert target_from_request(PlanRequest(gpus=4, gpu_mem="16GiB")).host_bytes is None  # no card: no default


def test_the_7b_answer_that_needed_337_gib_of_host_ram_is_refused_on_v100s():
    """The answer `plan recipes/llama2-7b-fsdp.yaml --gpus 4 --gpu V100-16GB` gave before host RAM
    bounded it: CPU offload + activations to host, every 2nd block checkpointed, micro-batch 16,
    75 + 262 GiB per node. With the V100's default (4 x 61 GiB) it does not fit; with --host-mem
    400GiB it does. (Its GPU side: 19.1 GiB on a 16 GB V100 since the allocator's reserve with
    offloading was measured, hardware.MEASURED_RESERVE; here the V100's host budget with 24 GiB of
    GPU memory, so that host RAM is what decides.)"""
    from shardtune.plan.fit import resolve_hf_config
    from shardtune.plan.menu import layout_cfg
    from shardtune.plan.search import estimate, screen

    cfg = load_config("recipes/llama2-7b-fsdp.yaml", [])
    hf_config, _ = resolve_hf_config(cfg)
    target = target_from_request(PlanRequest(gpus=4, gpu="V100-16GB", gpu_mem="24GiB"))
    old = Candidate("full_shard", "fp16", 16, "every_n", 2, activation_offload=True, cpu_offload=True)
    at = screen(layout_cfg(cfg, old, target), hf_config, target)
    est = estimate(at(16), hf_config, old, old.apply(cfg, target), target)
    assert est.host["cpu_offload"] / GIB == pytest.approx(75.3, rel=0.05)
    assert est.host["activation_offload"] / GIB == pytest.approx(262.6, rel=0.05)
    assert not est.fits and "of host RAM of 244.0 GiB" in est.why_not, est.why_not
    assert est.memory["total"] < target.memory_bytes * (1 - target.margin)  # the GPU alone would take it
    roomy = target_from_request(PlanRequest(gpus=4, gpu="V100-16GB", gpu_mem="24GiB", host_mem="400GiB"))
    assert estimate(at(16), hf_config, old, old.apply(cfg, roomy), roomy).fits


def test_the_answer_prints_the_host_budget_and_its_source():
    from shardtune.plan.report import _target_json, render

    def first_lines(req: PlanRequest) -> list[str]:
        answer = {"target": _target_json(target_from_request(req)), "best": None, "others": [],
                  "what_would_fit": []}
        return render(answer).splitlines()[:2]

    assert first_lines(PlanRequest(gpus=4, gpu="V100-16GB"))[1] == (
        "host RAM per node: 244 GiB (the default for V100-16GB: 61 GiB per GPU, as on AWS p3.8xlarge: 4 x V100 "
        "16GB, 244 GiB; --host-mem to change), bounding every answer")
    assert first_lines(PlanRequest(gpus=2, gpu="T4", host_mem="100GiB"))[1] == \
        "host RAM per node: 100 GiB (--host-mem), bounding every answer"
    assert "not bounded" in first_lines(PlanRequest(gpus=2, gpu_mem="16GiB"))[1]


@pytest.mark.parametrize("host_mem, shown", [("100MB", "0.093 GiB"), ("1.5GiB", "1.5 GiB"), ("244GiB", "244 GiB")])
def test_the_host_budget_is_printed_as_given(host_mem, shown):
    """--host-mem 100MB bounded every answer, and the answer said 'host RAM per node: 0 GiB'."""
    from shardtune.plan.report import _target_json, render

    target = target_from_request(PlanRequest(gpus=1, gpu="T4", host_mem=host_mem))
    text = render({"target": _target_json(target), "best": None, "others": [], "what_would_fit": []})
    assert f"host RAM per node: {shown} (--host-mem), bounding every answer" in text, text
