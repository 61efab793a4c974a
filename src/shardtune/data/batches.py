"""Batches: which samples each rank trains on at each step (`BatchPlan`), the validation
batches, and the tensors of a micro-batch (`collate`), assembled ahead of the step (`Prefetcher`).

The global order of an epoch is a seeded permutation of all samples (packed blocks or
examples); optimizer step s takes the next `global_batch_size` of it, and rank r's micro-batch
m inside that step is a fixed slice of them. The split depends only on (seed, epoch, step,
rank, world size), so any world size trains on exactly the same global batches.
"""

from __future__ import annotations

import torch

from shardtune.data import docmask
from shardtune.data.formats import IGNORE_INDEX
from shardtune.errors import UserError


def sample_lengths(ds) -> list[int] | None:
    """Per-sample token counts for BatchPlan(lengths=...), or None for packed (equal) blocks."""
    if "length" not in ds.column_names:
        return None
    return ds.with_format("numpy", columns=["length"])[:]["length"].tolist()


class BatchPlan:
    """Which samples rank `rank` uses for every micro-step of every optimizer step.

    With `lengths` (group_by_length), each epoch's shuffled order is cut into mega-chunks of
    GROUP_BATCHES global batches, each chunk is sorted longest first, and then the global
    batches are shuffled: micro-batches hold similar lengths (little padding) while the
    order of batches stays random. Like the plain order, it depends on (seed, epoch) only."""

    GROUP_BATCHES = 50

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int, world_size: int,
                 rank: int, seed: int, lengths=None):
        self.num_samples, self.global_batch, self.micro_batch = num_samples, global_batch, micro_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
        self.lengths = lengths
        self.accum = global_batch // (micro_batch * world_size)
        self.steps_per_epoch = num_samples // global_batch
        if self.steps_per_epoch == 0:
            raise UserError(f"the training split has {num_samples} sequences, fewer than "
                            f"train.global_batch_size={global_batch}; lower the batch size or data.seq_len")
        self._epoch, self._order = -1, None

    def order(self, epoch: int):
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=gen)
            if self.lengths is not None:
                order = self._grouped(order, gen)
            self._epoch, self._order = epoch, order
        return self._order

    def _grouped(self, order, gen):
        # The tail (not trained on this epoch) is cut before sorting, at random as in the plain order:
        # cut after, it was the shortest samples of the last chunk, left out of every epoch.
        usable = self.steps_per_epoch * self.global_batch
        kept, tail = order[:usable], order[usable:]
        lengths = torch.as_tensor(self.lengths)[kept]
        chunk = self.GROUP_BATCHES * self.global_batch
        parts = []
        for start in range(0, usable, chunk):
            by_len = torch.sort(lengths[start:start + chunk], descending=True, stable=True).indices
            parts.append(kept[start:start + chunk][by_len])
        batches = torch.cat(parts).view(self.steps_per_epoch, self.global_batch)
        shuffled = batches[torch.randperm(self.steps_per_epoch, generator=gen)].reshape(-1)
        return torch.cat([shuffled, tail])

    def global_indices(self, step: int) -> list[int]:
        """The sample indices of optimizer step `step` (0-based, counted over epochs), all ranks'."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[in_epoch * self.global_batch:(in_epoch + 1) * self.global_batch].tolist()

    def micro_batches(self, epoch: int, step_in_epoch: int) -> list[list[int]]:
        """`accum` lists of `micro_batch` sample indices for this rank at this step."""
        order = self.order(epoch)
        base = step_in_epoch * self.global_batch
        out = []
        for m in range(self.accum):
            start = base + (m * self.world_size + self.rank) * self.micro_batch
            out.append(order[start:start + self.micro_batch].tolist())
        return out


def batch_key(ds, plan: BatchPlan, step: int) -> str:
    """A digest of the sequences optimizer step `step` (0-based) trains, all ranks' (any world size and
    micro-batch: the same): a checkpoint records its next step's, and a resume whose next step would
    train other sequences (the same count, another order or other documents) is refused."""
    import copy
    import hashlib

    rows = ds[copy.copy(plan).global_indices(step)]  # a copy: the prefetcher's thread caches its epoch's order
    digest = hashlib.sha256()
    for key in ("input_ids", "labels"):
        values = rows.get(key)
        for t in values if isinstance(values, list) else [] if values is None else [values]:
            digest.update(repr(tuple(t.shape)).encode())
            digest.update(t.numpy().tobytes())
    return digest.hexdigest()[:16]


def eval_batches(num_samples: int, micro_batch: int, world_size: int, rank: int,
                 max_batches: int = 0) -> list[list[int]]:
    """Validation blocks for this rank in fixed order. Every rank gets the same number of
    batches (FSDP needs every rank in every forward); missing places are -1 (masked).
    `max_batches` caps the sequences at max_batches x micro_batch, the same set for any world size.
    A micro-batch above a rank's share of the sequences is that share: its other rows would be
    blanks only (a huge --micro-batch-size built them all, and ran out of memory)."""
    if max_batches:
        num_samples = min(num_samples, max_batches * micro_batch)
    micro_batch = max(1, min(micro_batch, -(-num_samples // world_size)))
    per_round = micro_batch * world_size
    rounds = -(-num_samples // per_round)
    batches = []
    for r in range(rounds):
        start = r * per_round + rank * micro_batch
        batches.append([i if i < num_samples else -1 for i in range(start, start + micro_batch)])
    return batches


def collate(ds, indices: list[int], device, pad_id: int = 0, padding_free: bool = False):
    """{input_ids, labels[, attention_mask][, position_ids]} tensors for these samples; index -1
    is a row with no loss. Packed blocks are stacked (document-masked ones bring their
    position_ids). Rows of different lengths are right-padded with `pad_id` (labels with
    IGNORE_INDEX) to the longest, with an `attention_mask` (1 = real token) — or, with
    `padding_free`, laid end to end in one row with restarting position_ids. A batch carries an
    attention mask only where a row is padded: given one, transformers checks it on the host
    (`masking_utils`: a synchronisation per forward) and attention cannot take the causal kernels."""

    real = [i if i >= 0 else 0 for i in indices]
    blank = [pos for pos, i in enumerate(indices) if i < 0]
    rows = ds[real]
    input_ids, labels = rows["input_ids"], rows.get("labels")
    batch = {}
    if isinstance(input_ids, torch.Tensor):  # equal lengths: stacked already
        labels = (labels if labels is not None else input_ids).clone()
        labels[blank] = IGNORE_INDEX
        if "position_ids" in rows:
            batch["position_ids"] = rows["position_ids"]
    else:
        labels = [torch.full_like(ids, IGNORE_INDEX) if pos in blank else lab
                  for pos, (ids, lab) in enumerate(zip(input_ids, labels if labels is not None else input_ids))]
        if padding_free:
            input_ids, labels, batch["position_ids"] = docmask.flatten(input_ids, labels)
        else:
            input_ids, labels, batch["attention_mask"] = _pad(input_ids, labels, pad_id)
    batch.update(input_ids=input_ids, labels=labels)
    return to_device(batch, device)


def describe_samples(ds, indices: list[int]) -> dict:
    """{"samples": dataset indices[, "documents": for each, the (first, last) document whose text
    it holds]}: where a step's data came from, for a message about that step."""
    out = {"samples": list(indices)}
    if hasattr(ds, "documents"):  # packed blocks
        out["documents"] = [list(ds.documents(i)) for i in indices]
    return out


def format_samples(origin: dict, shown: int = 32) -> str:
    """`describe_samples`' answer in a few words: '[5, 17 (documents 40-41), ...]'."""
    docs = origin.get("documents") or [None] * len(origin["samples"])
    words = [str(i) + ("" if d is None else f" (document {d[0]})" if d[0] == d[1] else f" (documents {d[0]}-{d[1]})")
             for i, d in zip(origin["samples"], docs, strict=True)]
    more = f", ... {len(words) - shown} more" if len(words) > shown else ""
    return "[" + ", ".join(words[:shown]) + more + "]"


def to_device(batch: dict, device) -> dict:
    """A CPU batch on `device`; page-locked first on CUDA, so the copy is asynchronous."""
    if device.type == "cpu":
        return batch
    return {k: (v if v.is_pinned() else v.pin_memory()).to(device, non_blocking=True) for k, v in batch.items()}


class Prefetcher:
    """The next step's micro-batches are assembled (dataset reads, padding, page-locking) in a
    background thread while the current step computes, so batch assembly is off the critical
    path; `take(step)` hands them over and says how long the loop waited for them."""

    def __init__(self, assemble, device, first_step: int, end_step: int):
        from concurrent.futures import ThreadPoolExecutor

        self.assemble, self.device, self.end = assemble, device, end_step
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches")
        self.pending = self._submit(first_step)

    def _submit(self, step: int):
        if step >= self.end:
            return None
        pin = self.device.type == "cuda"
        return step, self.pool.submit(lambda: [b if not pin else {k: v.pin_memory() for k, v in b.items()}
                                               for b in self.assemble(step)])

    def take(self, step: int) -> tuple[list[dict], float]:
        """(this step's micro-batches on the device, seconds waited for them)."""
        import time

        queued, future = self.pending
        assert queued == step, f"prefetched step {queued}, asked for {step}"
        start = time.perf_counter()
        batches = future.result()
        waited = time.perf_counter() - start
        self.pending = self._submit(step + 1)
        return [to_device(b, self.device) for b in batches], waited

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _pad(input_ids: list, labels: list, pad_id: int):
    """Rows right-padded to the longest: (input_ids, labels, attention_mask)."""

    width = max(len(x) for x in input_ids)
    padded = torch.full((len(input_ids), width), pad_id, dtype=input_ids[0].dtype)
    padded_labels = torch.full((len(input_ids), width), IGNORE_INDEX, dtype=input_ids[0].dtype)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for pos, (ids, lab) in enumerate(zip(input_ids, labels)):
        padded[pos, :len(ids)], padded_labels[pos, :len(ids)], mask[pos, :len(ids)] = ids, lab, 1
    return padded, padded_labels, mask
