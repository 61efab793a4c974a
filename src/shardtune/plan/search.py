"""`shardtune plan`'s search: the fastest configuration that fits.

A layout is what a trace depends on: sharding x compute precision x activation checkpointing
(none, selective, every n-th block, full) x activation offloading x gradient reduction dtype.
Each traced layout is traced on a 3- and a 4-block copy of the model at two micro-batches and
extrapolated to the model's depth and every micro-batch; the optimizer state precision (fp32,
bf16, 8-bit, 4-bit) and FSDP's CPU offload are priced from that one trace (`cost.py`). So the
search stays fast, layouts are traced in the order of the best speed they could reach, and not
at all once one fits that they could not beat by more than 1 % (a bound), or once a layout
needing less memory fits nowhere (a dominance): the lightest layout is traced first, and before
any other, the lightest of its sharding that could rule it out. Once one fits, a layout's copies
at the smaller micro-batch come first: where all its variants are too big there and the smaller
micro-batches could not win, the larger copies are not traced. The winner is traced whole to
confirm it. The traced copies are kept on disk per model shape (`trace_cache.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field

from shardtune.config.load import check_world
from shardtune.config.schema import RunConfig
from shardtune.errors import UserError, first_line
from shardtune.hardware import GIB
from shardtune.plan.cost import (
    CHECKPOINTING,
    STATE_PRECISIONS,
    Candidate,
    Target,
    gpu_memory,
    host_memory,
    setting,
    step_time,
)
from shardtune.plan.menu import SHARDING_ORDER, layout_cfg, layouts, micro_batches, needs_at_least
from shardtune.plan.trace import StepTrace
from shardtune.plan.trace_cache import TraceCache

SCREEN_DEPTHS = (3, 4)  # blocks in the copies the search traces; the phase peaks are linear beyond 2
SCREEN_MICRO = (2, 4)  # micro-batches traced; where a peak sits inside a block settles by about 2
TIE = 0.01  # speeds within 1 % are a tie


@dataclass
class Estimate:
    candidate: Candidate
    memory: dict  # cost.gpu_memory()
    host: dict  # cost.host_memory()
    step_seconds: float
    tokens_per_s: float
    accumulation: int
    fits: bool
    why_not: str = ""
    exact: bool = False  # traced whole (else extrapolated from the small copies)
    seconds: dict = field(default_factory=dict)  # step time by part (cost.step_time)
    trace: StepTrace | None = field(default=None, repr=False)
    at: object = field(default=None, repr=False)  # micro-batch -> StepTrace of this layout (screen())


# ----------------------------------------------------------------------------- tracing


def screen(cfg: RunConfig, hf_config, target: Target, device: str = "cuda", cache: TraceCache | None = None,
           micro: tuple[int, ...] = SCREEN_MICRO, traces: dict | None = None):
    """A function micro-batch -> StepTrace of `cfg` on `device`, extrapolated from small traced
    copies (two depths x two micro-batches; the model's own depth where it cannot be extrapolated),
    read from `cache` where traced before. With one of `micro`, the copies at that micro-batch only
    (the function then answers for it alone); `traces`: copies already traced, kept (.traces)."""
    from shardtune.plan import trace as trace_lib

    layers = trace_lib.layer_count(hf_config)
    traces = dict(traces or {})
    if cfg.peft.adapter_layers == layers:  # every block adapted, and so every block of a copy
        cfg = copy.deepcopy(cfg)
        cfg.peft.adapter_layers = None
    for depth in screen_depths(cfg, hf_config):
        for mb in micro:
            if (depth, mb) in traces:
                continue
            small = copy.deepcopy(cfg)
            small.train.micro_batch_size, small.train.global_batch_size = mb, 2 * mb * target.world  # 2 micro-steps
            traces[(depth, mb)] = (cache or TraceCache(None)).trace(small, hf_config, target.world,
                                                                    target.gpus_per_node, depth, device)
    if len(micro) == 1:  # linear in depth alone (extrapolate's second micro-batch is the first)
        at = functools.lru_cache(lambda mb: trace_lib.extrapolate(
            {**traces, **{(d, m + 1): t for (d, m), t in traces.items()}}, layers, micro[0]))
    else:
        at = functools.lru_cache(lambda mb: trace_lib.extrapolate(traces, layers, mb))
    at.traces = traces
    return at


def screen_depths(cfg: RunConfig, hf_config) -> tuple[int, ...]:
    """Depths of the small copies, or the model's own where it cannot be extrapolated (one unit per
    block is needed). Blocks that differ (every n-th checkpointed; per-layer patterns: sliding and
    full attention, a hybrid's linear and full attention, Gemma 4's wider full-attention layers)
    repeat every p blocks after the first q: the copies hold q + 2p and q + 3p blocks, so each
    added period is the model's mix (q + 3 and q + 4 where all blocks are alike: SCREEN_DEPTHS)."""
    from shardtune.families import layer_kinds
    from shardtune.plan import trace as trace_lib

    layers = trace_lib.layer_count(hf_config)
    if cfg.fsdp.wrap != "block" or cfg.freeze.trainable_blocks is not None \
            or cfg.peft.adapter_layers not in (None, layers) or _names_blocks(cfg.peft):  # some blocks alone adapted
        return (layers,)
    n = cfg.activation_checkpointing_every if cfg.activation_checkpointing == "every_n" else 1
    kinds = [(kind, i % n) for i, kind in enumerate(layer_kinds(hf_config))]
    for period in range(1, layers):
        start = max((i - period + 1 for i in range(period, layers) if kinds[i] != kinds[i - period]), default=0)
        low = start + (SCREEN_DEPTHS[0] if period == 1 else 2 * period)  # one period is not yet linear
        if low + period < layers:
            return low, low + period
    return (layers,)


def _names_blocks(peft) -> bool:
    """Whether peft's targets name modules of particular blocks (`layers.10.self_attn.q_proj`):
    a copy of 3 blocks has none of them, the model's blocks then differ."""
    names = (peft.target_modules or []) + (peft.feedforward_modules or [])
    return any(part.isdigit() for name in names for part in name.split("."))


def traced(make):
    """`make()`, or, where tracing fails, the failure in one line (the candidate is dropped with it,
    the search goes on): a model, recipe or torch version the fake trace cannot follow is one
    candidate's problem, never the planner's crash."""
    try:
        return make()
    except UserError as exc:
        return f"cannot be traced: {first_line(exc)}"
    except Exception as exc:  # noqa: BLE001 — any failure inside the traced step
        return f"cannot be traced: {type(exc).__name__}: {first_line(exc)}"


# ----------------------------------------------------------------------------- pricing


def estimate(trace: StepTrace, hf_config, cand: Candidate, cfg: RunConfig, target: Target) -> Estimate:
    """`cand` priced from a trace of its layout (any optimizer state: it is swapped in here)."""
    # the batch's accumulation alone (cand.apply's deep copy of the config per candidate was most of a search)
    batch = dataclasses.replace(cfg.train, micro_batch_size=cand.micro_batch)
    accum = check_world(dataclasses.replace(cfg, train=batch), target.world)
    trace = trace.with_state(cand.optimizer_state)
    if cfg.peft.quantize == "4bit":  # the LoRA step's trace, its base priced as bitsandbytes holds it
        from shardtune.plan.qlora import nf4_base, quantized

        trace = quantized(trace, nf4_base(hf_config, cfg.model.trust_remote_code))
    if accum == 1:  # one micro-step per step: the second one's phases do not happen
        trace = dataclasses.replace(trace, phases={k: v for k, v in trace.phases.items() if k[0] < 1})
    memory = gpu_memory(trace, cand.cpu_offload, target.world, cand.technique(cfg))
    host = host_memory(trace, cand.cpu_offload, target.gpus_per_node, target.world,
                       cfg.model.sharded_load and not cfg.model.random_init, cfg.checkpoint.sharded_final, cfg)
    seconds = step_time(trace, hf_config, cand, cfg, target, accum)
    budget = target.memory_bytes * (1 - target.margin)
    why = ""
    if memory["total"] > budget:
        why = f"needs {memory['total'] / GIB:.1f} GiB of {budget / GIB:.1f} GiB"
    elif target.host_bytes and host["total"] > target.host_bytes:
        why = f"needs {host['total'] / GIB:.1f} GiB of host RAM of {target.host_bytes / GIB:.1f} GiB"
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return Estimate(cand, memory, host, seconds["total"], tokens / seconds["total"], accum, not why, why,
                    seconds=seconds, trace=trace)


def variants(layout: Candidate, sizes: list[int], cpu_offload: bool = True) -> list[Candidate]:
    """The candidates one trace of `layout` prices: every optimizer state x CPU offload (fp32 state
    only: the offloaded optimizer is torch's CPU AdamW; none for QLoRA, which FSDP does not hold) x
    micro-batch."""
    from shardtune.plan.priced import available_states

    states = [(s, False) for s in available_states()] + ([("fp32", True)] if cpu_offload else [])
    return [dataclasses.replace(layout, micro_batch=mb, optimizer_state=s, cpu_offload=off)
            for s, off in states for mb in sizes]


def best_speed(layout: Candidate, params_trace: StepTrace, hf_config, cfg: RunConfig, target: Target,
               sizes: list[int], excluded: frozenset = frozenset()) -> float:
    """The most tokens/s any variant of `layout` could reach if it fit (memory unknown yet), but
    those `excluded` ((optimizer state, CPU offload, micro-batch) known not to fit); 0 if none is left."""
    bare = StepTrace({}, params_trace.layers, {}, {**params_trace.params, "offloaded_activations": 0})
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return max((tokens / step_time(bare, hf_config, c, cfg, target, cfg.train.global_batch_size //
                                   (c.micro_batch * target.world))["total"]
                for c in variants(layout, sizes, cfg.peft.quantize == "none")
                if (c.optimizer_state, c.cpu_offload, c.micro_batch) not in excluded), default=0.0)


# ----------------------------------------------------------------------------- search


def search(cfg: RunConfig, hf_config, target: Target, say=print, cache: TraceCache | None = None) -> list[Estimate]:
    """Every candidate, best first: the fitting ones by predicted tokens/s, then the others."""
    sizes = micro_batches(cfg, target.world)
    cache = cache or TraceCache(None)
    menu = layouts(cfg, target)
    lightest = min(menu, key=_lightness)
    estimates: list[Estimate] = []
    priced: dict[Candidate, tuple[list[Estimate], bool]] = {}  # traced layout -> its estimates, screened at
    # SCREEN_MICRO[0] only (their verdict then holds for every micro-batch from it up)
    budget = target.memory_bytes * (1 - target.margin)

    memo: dict[tuple, set] = {}

    def over(layout: Candidate, m: Candidate) -> set:  # too_big, once per lighter layout and technique
        key = (m, layout.checkpointing, layout.activation_offload)
        if key not in memo:
            memo[key] = too_big(layout, *priced[m], sizes, cfg, target, budget)
        return memo[key]

    def excluded(layout: Candidate) -> frozenset:  # its variants a lighter layout's trace shows too big
        return frozenset().union(*(over(layout, m) for m in priced if needs_at_least(layout, m)))
    bounds: dict[Candidate, float] = {}
    first: StepTrace | None = None  # the first trace: the parameter counts every bound needs
    fastest = 0.0  # tokens/s of the fastest candidate that fits so far
    order = [lightest] + [c for c in menu if c != lightest]
    while order:
        layout = order.pop(0)
        every = {(c.optimizer_state, c.cpu_offload, c.micro_batch)
                 for c in variants(layout, sizes, cfg.peft.quantize == "none")}
        heavier = next((m for m in priced if needs_at_least(layout, m) and every <= over(layout, m)), None)
        if heavier is not None:
            estimates.append(_skipped(layout, sizes[0], f"not traced: needs at least the memory of "
                                      f"{_layout_label(heavier)}, which fits nowhere"))
            continue
        if layout in bounds:  # its variants that a lighter layout's trace showed too big cannot fit either
            bounds[layout] = best_speed(layout, first, hf_config, cfg, target, sizes, excluded(layout))
        if bounds.get(layout) == 0.0:
            estimates.append(_skipped(layout, sizes[0], "not traced: each of its variants needs at least the "
                                      "memory of one a lighter layout's trace found too big"))
            continue
        if layout in bounds and bounds[layout] < fastest * (1 + TIE):  # at best a tie
            estimates.append(_skipped(layout, sizes[-1], f"not traced: at most {bounds[layout]:,.0f} tokens/s if it "
                                      f"fit, no faster than the {fastest:,.0f} of a layout that fits"))
            continue
        # the first of a sharding: the lightest of its layouts, not yet ruled out, first; where that
        # one fits nowhere, neither does any other of that sharding or a heavier one, untraced
        lighter = [c for c in order if c.sharding == layout.sharding and needs_at_least(layout, c)
                   and not (c in bounds and bounds[c] < fastest * (1 + TIE))]
        if lighter and not any(t.sharding == layout.sharding for t in priced):
            light = min(lighter, key=_lightness)
            order.remove(light)
            order[:0] = [light, layout]
            continue
        cache.announce = functools.partial(say, f"tracing {_layout_label(layout)}")  # not said for cached traces
        run = layout_cfg(cfg, layout, target)
        low = None
        if bounds and SCREEN_MICRO[0] in sizes:  # the copies at the smaller micro-batch first
            low = traced(lambda run=run: screen(run, hf_config, target, cache=cache, micro=SCREEN_MICRO[:1]))
            lean = None if isinstance(low, str) else _none_fit_from(low, layout, sizes, hf_config, cfg, run, target,
                                                                     budget, fastest, first, excluded(layout))
            if lean is not None:  # too big from that micro-batch up, no faster below it: no more copies
                estimates += lean
                priced[layout] = (lean, True)
                continue
        kept = None if low is None or isinstance(low, str) else low.traces
        at = traced(lambda run=run, kept=kept: screen(run, hf_config, target, cache=cache, traces=kept))
        if isinstance(at, str):  # this layout cannot be traced: its candidates say why
            estimates.append(_skipped(layout, sizes[0], at))
            continue
        batch = [estimate(at(c.micro_batch), hf_config, c, run, target)
                 for c in variants(layout, sizes, cfg.peft.quantize == "none")]
        for e in batch:
            e.at = at
        estimates += batch
        fastest = max([fastest] + [e.tokens_per_s for e in batch if e.fits])
        priced[layout] = (batch, False)
        if not bounds:  # the first trace gives the parameter counts every bound needs
            first = batch[0].trace
            bounds = {c: best_speed(c, first, hf_config, cfg, target, sizes) for c in order}
            # fastest first; among speeds within a tie, the closest to the recipe (what the ranking
            # prefers), then the lighter (the likelier to fit)
            order.sort(key=lambda c: (-round(math.log(bounds[c]) / TIE), changes(c, cfg),
                                      SHARDING_ORDER[c.sharding], not c.activation_offload, c.reduce_dtype != "bf16"))
    cache.announce = None  # the last layout's, if all its traces were read
    return rank(estimates, cfg)


def _none_fit_from(low, layout: Candidate, sizes: list[int], hf_config, cfg: RunConfig, run: RunConfig,
                   target: Target, budget: float, fastest: float, first: StepTrace, excluded: frozenset):
    """`layout`'s variants at the smaller screened micro-batch (from copies traced at that one only),
    if every one of them is too big there (a larger micro-batch never holds less) and those at
    smaller micro-batches could not beat `fastest` by more than a tie (`excluded`: its variants that
    lighter layouts' traces show too big); else None (trace on)."""
    mb = SCREEN_MICRO[0]
    batch = [estimate(low(mb), hf_config, c, run, target) for c in variants(layout, [mb], cfg.peft.quantize == "none")]
    if any(e.memory["total"] <= budget for e in batch):
        return None
    over = {(e.candidate.optimizer_state, e.candidate.cpu_offload, m) for e in batch for m in sizes if m >= mb}
    known = frozenset(over) | excluded
    below = best_speed(layout, first, hf_config, cfg, target, sizes, known)
    if below >= fastest * (1 + TIE):
        return None
    for e in batch:
        e.why_not += (f" at micro-batch {mb}, more above it; below it at most {below:,.0f} tokens/s, no faster "
                      f"than the {fastest:,.0f} of a layout that fits (traced at micro-batch {mb} only)")
    return batch


def too_big(heavy: Candidate, batch: list[Estimate], screened: bool, sizes: list[int], cfg: RunConfig,
            target: Target, budget: float) -> set:
    """The variants (optimizer state, CPU offload, micro-batch) of layout `heavy` that cannot fit, from
    the estimates of a layout it needs at least the memory of (`needs_at_least`: its trace holds no
    more bytes): those over `budget` even at `heavy`'s allocator reserve, which is per technique
    (hardware.MEASURED_RESERVE: about 2 of the transient bytes with activations offloaded, 0.5 with full
    checkpointing, 0.1 with none). Judged at the lighter layout's own reserve, a heavier layout that
    fit was never traced: 'nothing fits' where no checkpointing fit and full checkpointing with
    activations to host did not. `screened`: estimates at SCREEN_MICRO[0] alone, whose verdict holds
    from it up."""
    out = set()
    for e in batch:
        c = dataclasses.replace(e.candidate, checkpointing=heavy.checkpointing,
                                activation_offload=heavy.activation_offload)
        if gpu_memory(e.trace, c.cpu_offload, target.world, c.technique(cfg))["total"] > budget:
            out |= {(c.optimizer_state, c.cpu_offload, mb) for mb in sizes
                    if (mb >= c.micro_batch if screened else mb == c.micro_batch)}
    return out


def _lightness(c: Candidate) -> tuple:
    """Sorts the layouts that likely need the least memory first."""
    return (SHARDING_ORDER[c.sharding], CHECKPOINTING[::-1].index(c.checkpointing), not c.activation_offload,
            c.reduce_dtype != "bf16", c.precision == "fp32")


def _layout_label(c: Candidate) -> str:
    ac = f"every {c.every}" if c.checkpointing == "every_n" else c.checkpointing
    return (f"{c.sharding}, {c.precision}, activation checkpointing {ac}"
            f"{', activations to host' if c.activation_offload else ''}"
            f"{', bf16 reduce' if c.reduce_dtype == 'bf16' else ''}")


def _skipped(layout: Candidate, micro_batch: int, reason: str) -> Estimate:
    return Estimate(dataclasses.replace(layout, micro_batch=micro_batch), {}, {}, float("inf"), 0.0, 0, False, reason)


def changes(c: Candidate, cfg: RunConfig) -> int:
    """How many settings of the recipe `c` changes (its micro-batch aside, and a mode the recipe's
    activation_checkpointing=auto leaves to the planner)."""
    return sum(v != setting(cfg, k) for k, v in c.settings().items() if k != "train.micro_batch_size"
               and setting(cfg, k) != "auto")


def rank(estimates: list[Estimate], cfg: RunConfig) -> list[Estimate]:
    """Fitting first, fastest first; within 1 % of the fastest, the fewest changes to the recipe,
    the most precise optimizer state, the fewest activations in host memory, the larger
    micro-batch (better GEMM efficiency than the model counts), then the least memory."""
    top = max((e.tokens_per_s for e in estimates if e.fits), default=0.0)

    def speed(e: Estimate) -> float:  # within TIE of the fastest that fits: a tie
        return top if e.fits and e.tokens_per_s >= top * (1 - TIE) else e.tokens_per_s
    return sorted(estimates, key=lambda e: (not e.fits, -speed(e), changes(e.candidate, cfg),
                                            STATE_PRECISIONS.index(e.candidate.optimizer_state),
                                            e.host.get("activation_offload", 0), -e.candidate.micro_batch,
                                            e.memory.get("total", 0)))


CONFIRMED = 3  # candidates traced whole, in order, before the plan says nothing fits


def confirm(best: list[Estimate], cfg: RunConfig, hf_config, target: Target,
            cache: TraceCache | None = None) -> Estimate | None:
    """Trace the top candidates whole, in order, until one fits: the answer rests on a full trace.
    Where the first CONFIRMED all fail theirs, the later extrapolated fits are no longer called fits
    (the answer said "nothing fits" above a list of layouts that "fit")."""
    from shardtune.plan import trace as trace_lib

    whole = cache.trace if cache is not None else trace_lib.trace_step
    for est in best[:CONFIRMED]:
        if not est.fits:
            return None
        run = est.candidate.apply(cfg, target)
        full = traced(lambda run=run: whole(run, hf_config, target.world, target.gpus_per_node, target="cuda"))
        if isinstance(full, str):
            est.fits, est.why_not = False, f"extrapolated fit, but the full trace {full}"
            continue
        exact = estimate(full, hf_config, est.candidate, run, target)
        exact.exact, exact.at = True, est.at
        if exact.fits:
            return exact
        est.fits, est.why_not = False, f"extrapolated fit, but the full trace {exact.why_not}"
    for est in best[CONFIRMED:]:
        if est.fits:
            est.fits, est.why_not = False, (f"extrapolated fit, not traced whole: the {CONFIRMED} best "
                                            "extrapolated fits failed their full traces")
    return None

