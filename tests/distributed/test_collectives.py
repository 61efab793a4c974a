"""The small collectives, on a simulated world of two (the peer's numbers are the all-reduce's)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtune.distributed.collectives import all_max


def test_all_max_takes_each_number_at_its_largest_over_the_ranks(monkeypatch):
    """A per-device peak (memory) in the log is the fullest rank's; it was rank 0's."""
    peer = torch.tensor([3.0, 0.5, 7.0], dtype=torch.float64)  # the other rank's values, in the same order

    def all_reduce(t, op):
        assert op == dist.ReduceOp.MAX and t.device.type == "cpu"  # gloo: not behind the device's queue
        t.copy_(torch.maximum(t, peer))

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend_config", lambda: "cuda:nccl,cpu:gloo")  # a CUDA run's group
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    ours = {"mem_allocated_gib": 2.0, "mem_reserved_gib": 4.0, "mem_live_peak_gib": 1.0}
    device = torch.device("meta")  # stands for the run's CUDA device: the numbers stay off it
    assert all_max(ours, device) == {"mem_allocated_gib": 3.0, "mem_reserved_gib": 4.0, "mem_live_peak_gib": 7.0}
    assert all_max({}, device) == {}
