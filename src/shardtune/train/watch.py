"""Watching gradients and parameters (`log.watch`): every `log.watch_every` steps, the L2 norm of
each block's gradients (before clipping) and parameters (after the update).

Computed from the FSDP shards, never gathering a parameter: each rank sums the squares of its
local shards per block (one `_foreach_norm` over the tensors), the sums meet in one all-reduce,
and a tensor replicated over R ranks (no_shard, hybrid_shard's replicas) counts 1/R from each.
Everything stays on the device: the loop reads the norms with the step's other numbers.

Histograms (for the trackers that take them: TensorBoard, W&B; MLflow has none): per block,
`BINS` counts over [-m, m], m the block's max |value| over all ranks (one MAX all-reduce),
binned from the local shards as torch.histc bins; the counts join the norms' one SUM all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtune.telemetry.trackers import Histogram

KINDS = {"gradients": ("grad",), "parameters": ("param",), "all": ("grad", "param")}
BINS = 64  # histogram bins per block
CHUNK = 1 << 22  # values binned at once: bounds the bin-index scratch (8 bytes a value)


def block_groups(model, block_cls) -> tuple[list[str], list[int]]:
    """(group names, the group of each trainable parameter in `model.named_parameters()` order):
    one group per decoder block (named by its last two path parts, e.g. `h.3`, `layers.3`), the
    parameters before the first block `embeddings`, after the last `head`."""
    blocks = [name for name, m in model.named_modules() if block_cls is not None and isinstance(m, block_cls)]
    names, index = [], []
    seen_block = False
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is not None:
            seen_block = True
            group = ".".join(block.split(".")[-2:])
        else:
            group = "head" if seen_block else "embeddings"
        if group not in names:
            names.append(group)
        index.append(names.index(group))
    return names, index


def replicas(p) -> int:
    """How many ranks hold the same values of `p`'s local tensor (1 for a fully sharded DTensor)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return world  # a plain tensor: every rank has all of it
    shards = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard():
            shards *= mesh.size(i)
    return world // shards


class Watch:
    """Per-block norms (and histograms) of one model; `due(step)` says when, `grads()` /
    `params_now()` queue them, `finish()` sums them over ranks. One kind's device tensor holds,
    per group, [sum of squares, sum] then BINS counts per group, then (after finish) m per group."""

    def __init__(self, model, block_cls, mode: str, every: int, device, histograms: bool = False):
        self.kinds, self.every, self.histograms = KINDS.get(mode, ()), every, histograms
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names, index = block_groups(model, block_cls)
        self.group = index
        self.index = torch.tensor(index, dtype=torch.long, device=device)
        self.share = [1.0 / replicas(p) for p in self.params]
        self.weight = torch.tensor(self.share, dtype=torch.float64, device=device)
        self.device, self.zero = device, torch.zeros(1, device=device)

    def due(self, step: int) -> bool:
        return bool(self.kinds) and step % self.every == 0

    def keys(self) -> list[str]:
        return [f"{kind}_norm/{name}" for kind in self.kinds for name in self.names]

    def _stats(self, tensors: list) -> torch.Tensor:
        """This rank's weighted per-group sums of squares (and, with histograms, sums, counts
        and the global max |value|); a tensor that is None counts 0. No tensor is made from
        host numbers here: on CUDA that copy would wait for the queue."""
        local = [self.zero if t is None else (t.to_local() if hasattr(t, "to_local") else t) for t in tensors]
        local = [t if t.numel() else self.zero for t in local]  # a rank may hold no rows of a small tensor
        groups = len(self.names)
        norms = torch.stack(torch._foreach_norm(local, 2)).double()
        squares = torch.zeros(groups, dtype=torch.float64, device=self.device)
        squares.index_add_(0, self.index, norms.square() * self.weight)
        if not self.histograms:
            return squares
        sums = torch.zeros(groups, dtype=torch.float64, device=self.device)
        sums.index_add_(0, self.index, torch.stack([t.sum(dtype=torch.float64) for t in local]) * self.weight)
        top = torch.stack(torch._foreach_norm(local, float("inf"))).float()
        reach = torch.zeros(groups, device=self.device).scatter_reduce_(0, self.index, top, "amax")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(reach, op=dist.ReduceOp.MAX)
        counts = torch.zeros(groups * BINS, dtype=torch.float64, device=self.device)
        for t, g, share in zip(local, self.group, self.share, strict=True):
            m = reach[g]
            for part in t.detach().reshape(-1).split(CHUNK):
                # torch.histc's bin of x in [-m, m]; m = 0 (all zeros) puts everything mid-range
                pos = ((part.float() + m) * BINS / (2 * m).clamp_min(torch.finfo(torch.float32).tiny)).long()
                pos = pos.clamp_(0, BINS - 1) + g * BINS
                counts.index_add_(0, pos, torch.ones_like(pos, dtype=torch.float64), alpha=share)
        return torch.cat([squares, sums, counts, reach.double()])

    def grads(self) -> torch.Tensor:
        return self._stats([p.grad for p in self.params])

    def params_now(self) -> torch.Tensor:
        return self._stats([p.detach() for p in self.params])

    def finish(self, grads: torch.Tensor | None, params: torch.Tensor | None) -> torch.Tensor:
        """The watched kinds summed over ranks, in one device tensor: all norms (`keys()` order),
        then per kind with histograms the sums and counts, then the ranges (already global)."""
        parts = [t for kind, t in (("grad", grads), ("param", params)) if kind in self.kinds]
        groups = len(self.names)
        squares = [t[:groups] for t in parts]
        summed = [t[groups:-groups] for t in parts] if self.histograms else []
        total = torch.cat(squares + summed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        norms = total[:groups * len(parts)].sqrt()
        reach = [t[-groups:] for t in parts] if self.histograms else []
        return torch.cat([norms, total[groups * len(parts):], *reach])

    def record(self, watched: torch.Tensor) -> dict:
        """The host's view of the norms (the loop calls this when it reads the step's numbers)."""
        values = watched.tolist()
        return dict(zip(self.keys(), values[:len(self.keys())], strict=True))

    def histograms_of(self, watched: torch.Tensor) -> dict:
        """{`grad_hist/<block>`: Histogram} (and `param_hist/`), {} without histograms."""
        if not self.histograms:
            return {}
        groups, kinds = len(self.names), len(self.kinds)
        values = watched.double().cpu()
        norms, rest = values[:groups * kinds], values[groups * kinds:]
        per_kind = groups * (1 + BINS)
        out = {}
        for k, kind in enumerate(self.kinds):
            sums = rest[k * per_kind:k * per_kind + groups]
            counts = rest[k * per_kind + groups:(k + 1) * per_kind].view(groups, BINS)
            reach = rest[kinds * per_kind + k * groups:kinds * per_kind + (k + 1) * groups]
            for g, name in enumerate(self.names):
                m = float(reach[g])
                out[f"{kind}_hist/{name}"] = Histogram(-m, m, counts[g].tolist(), float(sums[g]),
                                                       float(norms[k * groups + g]) ** 2)
        return out

