"""Collectives over the default process group: sums, broadcasts, rank-0-first."""

from __future__ import annotations

from shardtune.distributed.process_group import Dist
from shardtune.errors import UserError


def rank0_first(dist: Dist, fn):
    """Run `fn` on rank 0, then on the others (e.g. to fill a cache once). A UserError on
    rank 0 is re-raised on every rank instead of leaving the others waiting forever."""
    import torch.distributed as tdist

    result, error = None, None
    if dist.is_main:
        try:
            result = fn()
        except UserError as exc:
            error = str(exc)
    if dist.world_size > 1:
        box = [error]
        tdist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise UserError(error)
    return result if dist.is_main else fn()


def broadcast_value(dist: Dist, value):
    """Rank 0's `value` on every rank."""
    if dist.world_size == 1:
        return value
    import torch.distributed as tdist

    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def same_on_every_rank(dist: Dist, values: dict, fix: str, what: str = "run different configs") -> None:
    """A UserError on every rank alike where any rank's `values` (names to plain values) differ from
    rank 0's, naming the first such name, both values and `fix`. Ranks that resolved their own values
    (torchrun's and srun's each resolve `auto` on their own machine, read their own node's recipe
    and data files) and differ would otherwise hang at the first collective they count differently."""
    if dist.world_size == 1:
        return
    import torch.distributed as tdist

    seen: list = [None] * dist.world_size
    tdist.all_gather_object(seen, values)
    for name, first in seen[0].items():
        other = next((rank for rank, v in enumerate(seen) if v.get(name) != first), None)
        if other is not None:
            raise UserError(f"the ranks of this job {what}: {name} is {first!r} on rank 0 but "
                            f"{seen[other].get(name)!r} on rank {other}; {fix}")


def all_sum(*values, device) -> list[float]:
    """The element-wise sum of `values` over all ranks, as floats (one all-reduce; a host sync)."""
    return all_sum_on_device(*values, device=device).tolist()


def all_max(values: dict, device) -> dict:
    """`values` (host numbers by name; every rank has the same names) each at its largest over all
    ranks: a peak that is one device's, like its memory, is the fullest one's. Reduced in host
    memory where the group has a CPU backend (gloo beside NCCL: init_distributed's): a tensor
    on `device` would wait for the work queued there, the next step's included."""
    import torch
    import torch.distributed as dist

    if not values or dist.get_world_size() == 1:
        return values
    where = "cpu" if "cpu:" in dist.get_backend_config() else device
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist(), strict=True))


def all_sum_on_device(*values, device):
    """The element-wise sum of `values` over all ranks as one float64 tensor on `device`: the
    all-reduce is queued, nothing waits for it until the tensor is read."""
    import torch.distributed as dist

    t = stack_on_device(*values, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def stack_on_device(*values, device):
    """Numbers and 0-d tensors as one float64 tensor on `device`. Python numbers are filled in
    there: a copy from host memory could wait for the device's queue."""
    import torch

    return torch.stack([v.to(device, torch.float64) if isinstance(v, torch.Tensor)
                        else torch.full((), float(v), dtype=torch.float64, device=device) for v in values])
