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


def test_ranks_that_resolved_different_configs_are_refused_alike(monkeypatch, assets, tmp_path):
    """torchrun's and srun's ranks each resolve the run themselves: train.micro_batch_size=auto on their own
    node's free memory (or GPU), the recipe from their own node's disk. Ranks that differed trained on: a
    different micro-batch counts different accumulation steps, and the ranks hung at a collective one of
    them never reached. Each rank now sees every rank's config when it joins, and all refuse alike."""

    from conftest import tiny_overrides
    from shardtune.check.run import check_run
    from shardtune.config.load import load_config
    from shardtune.distributed.process_group import Dist
    from shardtune.errors import UserError
    from shardtune.resolve.run import resolve_run
    from shardtune.telemetry.trackers import flatten
    from shardtune.train import trainer

    def resolved(mb: int):
        cfg = load_config(None, tiny_overrides(assets, tmp_path / "run", **{"train.micro_batch_size": mb}))
        return resolve_run(cfg, 2, say=lambda line: None)

    ours, peer = resolved(2), resolved(1)  # e.g. auto on two nodes of different free memory
    monkeypatch.setattr(trainer, "init_distributed", lambda device: Dist(0, 2, 2, torch.device("cpu")))
    for other, refused in ((peer, True), (ours, False)):
        def all_gather_object(seen, value, other=other):
            seen[:] = [value, flatten(other.to_dict())]
        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
        try:
            trainer.Trainer(check_run(ours, 2))
        except UserError as exc:
            assert refused and str(exc).startswith("the ranks of this job run different configs: "
                                                   "train.micro_batch_size is 2 on rank 0 but 1 on rank 1; "), exc
        except (RuntimeError, ValueError):  # past the check, at the next collective of this simulated world
            assert not refused
        else:
            raise AssertionError("a world of two built without its peer")
