"""Watching gradients and parameters (`log.watch`): every `log.watch_every` steps, the L2 norm of
each block's gradients (before clipping) and parameters (after the update).

Computed from the FSDP shards, never gathering a parameter: each rank sums the squares of its
local shards per block (one `_foreach_norm` over the tensors), the sums meet in one all-reduce,
and a tensor replicated over R ranks (no_shard, hybrid_shard's replicas) counts 1/R from each.
Everything stays on the device: the loop reads the norms with the step's other numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

KINDS = {"gradients": ("grad",), "parameters": ("param",), "all": ("grad", "param")}


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
    """Per-block norms of one model; `due(step)` says when, `grads()` / `params()` queue them."""

    def __init__(self, model, block_cls, mode: str, every: int, device):
        self.kinds, self.every = KINDS.get(mode, ()), every
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names, index = block_groups(model, block_cls)
        self.index = torch.tensor(index, dtype=torch.long, device=device)
        self.weight = torch.tensor([1.0 / replicas(p) for p in self.params], dtype=torch.float64, device=device)
        self.device, self.zero = device, torch.zeros(1, device=device)

    def due(self, step: int) -> bool:
        return bool(self.kinds) and step % self.every == 0

    def keys(self) -> list[str]:
        return [f"{kind}_norm/{name}" for kind in self.kinds for name in self.names]

    def _squares(self, tensors: list) -> torch.Tensor:
        """This rank's weighted sum of squares per group (a tensor that is None counts 0). No
        tensor is made from host numbers here: on CUDA that copy would wait for the queue."""
        local = [self.zero if t is None else (t.to_local() if hasattr(t, "to_local") else t) for t in tensors]
        norms = torch.stack(torch._foreach_norm(local, 2)).double()
        sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        return sums.index_add_(0, self.index, norms.square() * self.weight)

    def grads(self) -> torch.Tensor:
        return self._squares([p.grad for p in self.params])

    def params_now(self) -> torch.Tensor:
        return self._squares([p.detach() for p in self.params])

    def finish(self, grads: torch.Tensor | None, params: torch.Tensor | None) -> torch.Tensor:
        """The norms of the kinds watched, summed over ranks: one device tensor, `keys()` order."""
        parts = [t for kind, t in (("grad", grads), ("param", params)) if kind in self.kinds]
        sums = torch.cat(parts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        return sums.sqrt()

    def record(self, norms: torch.Tensor) -> dict:
        """The host's view (the loop calls this when it reads the step's numbers)."""
        return dict(zip(self.keys(), norms.tolist(), strict=True))
