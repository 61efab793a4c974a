"""`sweep --max-batch`: the largest micro-batch per rank that fits, found with few real trials,
seeded by `shardtune plan`'s predictions against the memory a trial may use; and a grid point's
`train.micro_batch_size=auto` resolved as `train` would. `sweep` arguments are grid.Sweep."""

from __future__ import annotations

import os

from shardtune.errors import UserError, first_line
from shardtune.hardware import GIB
from shardtune.sweep.report import describe, method_label, slug, summarize_point
from shardtune.sweep.trial import not_run

VERDICTS = {"ok": "fits", "oom": "too_big", "over_limit": "too_big"}  # a trial's status, for the search


def micro_batch_candidates(cfg, nproc: int) -> list[int]:
    """Micro-batches that keep the global batch: the divisors of global batch / ranks."""
    per_rank, rest = divmod(cfg.train.global_batch_size, nproc)
    return [] if rest else [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def search_max_batch(candidates: list[int], seed: int, attempt, reseed=None) -> tuple[int | None, str]:
    """Largest candidate for which `attempt(mb)` says "fits", probing few: the seed (an index),
    then one step up or down, doubling the step while every answer agrees, then bisecting between
    the largest fit and the smallest misfit. "broken" (a crash that is not memory) ends the search.
    `reseed()`, asked once after the first trial, may name a better next index (the prediction
    against what that trial measured). Returns (largest fitting micro-batch or None, why)."""
    lo, hi = -1, len(candidates)  # largest index known to fit, smallest known not to
    index, stride = seed, 1
    while True:
        verdict = attempt(candidates[index])
        if verdict == "broken":
            return (candidates[lo] if lo >= 0 else None), "broken"
        if verdict == "fits":
            lo = index
        else:
            hi = index
        if hi - lo <= 1:
            break
        better, reseed = (reseed() if reseed else None), None
        if better is not None and lo < better < hi:
            index = better
        elif hi == len(candidates):  # nothing has failed yet: climb
            index, stride = min(lo + stride, hi - 1), stride * 2
        elif lo < 0:  # nothing has fitted yet: descend
            index, stride = max(hi - stride, 0), stride * 2
        else:
            index = (lo + hi) // 2
    if lo < 0:
        return None, "none fits"
    return candidates[lo], "all fit" if lo == len(candidates) - 1 else "boundary"


def seed_index(candidates: list[int], start: int, budget: int | None, predict=None) -> int:
    """Where the search starts: the largest micro-batch whose predicted peak fits the budget
    (bisection: predictions grow with the micro-batch), else the recipe's own micro-batch."""
    if predict is None or budget is None or predict(candidates[0]) is None:
        return max([i for i, mb in enumerate(candidates) if mb <= start] or [0])
    lo, hi = -1, len(candidates)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        peak = predict(candidates[mid])  # None: the planner cannot say at this size (taken as not fitting)
        lo, hi = (mid, hi) if peak is not None and peak <= budget else (lo, mid)
    return max(lo, 0)


class Predictions:
    """`shardtune plan`'s predicted peak bytes of live tensors per rank for a trial's config,
    each a fake-tensor trace of one step (seconds), so cached. None where the planner cannot
    predict (it says why once)."""

    def __init__(self, sweep):
        self.sweep, self.cache, self.warned = sweep, {}, set()

    def __call__(self, point: dict, micro_batch: int | None, checkpointing: str | None = None) -> int | None:
        key = (tuple(point.items()), micro_batch, checkpointing)
        if key not in self.cache:
            from transformers.utils import logging as hf_logging

            from shardtune.plan.fit import predict_peak_bytes

            hf_logging.set_verbosity_error()  # config warnings belong to the trials' own output
            try:
                self.cache[key] = predict_peak_bytes(self.sweep.config(point, micro_batch, checkpointing),
                                                     self.sweep.nproc)
            except Exception as exc:  # noqa: BLE001  a config the planner cannot build: its trial will say why
                self.cache[key] = None
                if key[0] not in self.warned:
                    self.warned.add(key[0])
                    print(f"  no memory prediction for {method_label(point)}: "
                          f"{type(exc).__name__}: {first_line(exc)}", flush=True)
        return self.cache[key]


def memory_limit(sweep) -> int | None:
    """Bytes per rank: --mem-limit, else the GPU's memory; on CPU without --mem-limit, the
    machine's memory over the ranks (the cap that keeps a max-batch search from swapping)."""
    if sweep.mem_limit:
        return sweep.mem_limit
    if sweep.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    if sweep.max_batch:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // sweep.nproc
    return None


def tensor_budget(limit: int | None, device: str, records: list[dict]) -> int | None:
    """What of a rank's memory limit its tensors may use. A CPU cap also holds the interpreter and
    libraries: what finished trials held beyond their tensors (RSS - live peak), else about what
    this process holds, having loaded the same libraries to predict."""
    if limit is None or device != "cpu":
        return limit
    from shardtune.telemetry.metrics import peak_rss_bytes

    measured = [(r["mem_rss_gib"] - r["mem_live_gib"]) * GIB for r in records
                if r["status"] == "ok" and r.get("mem_rss_gib") and r.get("mem_live_gib")]
    return limit - int(max(measured) if measured else peak_rss_bytes())


def auto_layout(sweep, point: dict, limit: int | None, records: list[dict]) -> tuple[int | None, str | None]:
    """A grid point's train.micro_batch_size=auto and activation_checkpointing=auto, resolved here as
    `train` would (on CPU within --mem-limit where given), so the trial runs and is recorded with
    them: (micro-batch, checkpointing mode), each None where the point sets it. The trial is handed
    both: left to resolve a mode itself, it measured against the machine's free RAM, not --mem-limit."""
    cfg = sweep.config(point)
    auto_mb, auto_ck = cfg.train.micro_batch_size == "auto", cfg.activation_checkpointing == "auto"
    if not (auto_mb or auto_ck):
        return None, None
    from shardtune.plan.fit import resolve_layout
    from shardtune.resolve.run import resolve_machine

    budget = tensor_budget(limit, sweep.device, records) if sweep.mem_limit else None
    # for the device and compile the trial resolves (unresolved, compile=auto was priced compiled on CPU)
    micro_batch, mode, line = resolve_layout(resolve_machine(cfg), sweep.nproc, sweep.nproc, host_budget=budget)
    print(f"  {slug(point) or 'recipe'}: {line}", flush=True)
    return (micro_batch if auto_mb else None), (mode if auto_ck else None)


def max_batch_of(sweep, point: dict, trial, predict, limit: int | None, records_so_far: list[dict]) -> dict:
    """The largest micro-batch of one grid point that fits, searched with real trials from the
    prediction's seed; its table row."""
    cfg = sweep.config(point)
    candidates = micro_batch_candidates(cfg, sweep.nproc)
    predict(point, candidates[0])  # first: it loads the libraries the budget's estimate counts
    budget = tensor_budget(limit, sweep.device, records_so_far)
    seed = seed_index(candidates, cfg.train.micro_batch_size, budget, lambda mb: predict(point, mb))
    records = []

    def attempt(micro_batch: int) -> str:
        records.append(trial(point, micro_batch))
        return VERDICTS.get(records[-1]["status"], "broken")

    def reseed() -> int:  # the first trial measured what the process holds beside its tensors
        return seed_index(candidates, cfg.train.micro_batch_size,
                          tensor_budget(limit, sweep.device, records_so_far + records),
                          lambda mb: predict(point, mb))

    best, why = search_max_batch(candidates, seed, attempt, reseed)
    return summarize_point(point, records, best, why)


def one_trial_of(sweep, point: dict, trial, limit: int | None, records: list[dict]) -> dict:
    """The table row of a grid point without --max-batch: its one trial, at the point's `auto` layout.
    A finished one is taken as it is (planned again with what the finished trials measured, an `auto`
    micro-batch could come out another and rerun the point); a point nothing fits for is a failed trial
    that says why, and the sweep goes on (not kept in sweep.json: a rerun plans it again)."""
    if done := [r for r in records if r["point"] == point]:
        return summarize_point(point, done, None, "")
    try:
        micro_batch, mode = auto_layout(sweep, point, limit, records)
    except UserError as exc:
        record = not_run(point, slug(point), str(exc))
        print(f"  {describe(record)}", flush=True)
        return summarize_point(point, [record], None, "")
    return summarize_point(point, [trial(point, micro_batch, mode)], None, "")
