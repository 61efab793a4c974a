"""`shardtune plan`'s command: read the request, run the search (plan/search.py), print the answer —
the winner's per-rank breakdown and command line, why the others were dropped, and when nothing
fits, what would (more GPUs, LoRA, QLoRA, a shorter sequence), with numbers."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import shlex
import sys
from dataclasses import dataclass

from shardtune.config.schema import RunConfig
from shardtune.errors import UserError
from shardtune.hardware import GIB, STATES, calibrated, float8_needs, gpu_by_name, parse_size
from shardtune.plan.cost import Candidate, Target, setting
from shardtune.plan.fit import resolve_hf_config
from shardtune.plan.keys import refuse_unpriced
from shardtune.plan.menu import layout_cfg
from shardtune.plan.search import TIE, Estimate, confirm, estimate, screen, search
from shardtune.plan.trace_cache import TraceCache

ROWS = [("sharded_params", "sharded parameters"), ("gathered_params", "gathered parameters"),
        ("gradients", "sharded gradients"), ("gathered_grads", "unsharded gradients"),
        ("optimizer_state", "optimizer state"), ("optimizer_step", "optimizer step"),
        ("activations", "activations"),
        ("temporaries", "temporaries"), ("communication", "communication buffers"), ("buffers", "model buffers")]
# offloaded activations are host memory: the host line shows them


@dataclass
class PlanRequest:
    """The machine to plan for and how to answer (cli/plan.py builds it from the flags)."""
    gpus: int | None  # per node
    nodes: int = 1
    gpu: str | None = None  # a name in hardware.GPUS; or give gpu_mem
    gpu_mem: str | None = None  # e.g. "16GiB"; overrides the GPU's
    host_mem: str | None = None  # host RAM per node
    peak_tflops: float | None = None
    bandwidth: float | None = None  # GB/s per GPU inside a node
    inter_node_bandwidth: float | None = None  # GB/s per GPU between nodes
    margin: float = 0.05  # share of GPU memory kept free
    json: bool = False  # machine-readable answer on stdout, progress on stderr


def target_from_request(req: PlanRequest) -> Target:
    if req.gpus is None:
        raise UserError("plan needs the GPUs per node: --gpus N (e.g. --gpus 4)")
    if req.gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {req.gpus}; give the GPUs per node, e.g. --gpus 4")
    if req.nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {req.nodes}")
    if not req.gpu and not req.gpu_mem:
        raise UserError("say which GPU: --gpu NAME (e.g. --gpu A100-80GB) or --gpu-mem SIZE (e.g. --gpu-mem 16GiB)")
    gpu = gpu_by_name(req.gpu) if req.gpu else None
    memory = parse_size(req.gpu_mem, "--gpu-mem") if req.gpu_mem else gpu.memory_bytes
    host, host_source = (parse_size(req.host_mem, "--host-mem"), "--host-mem") if req.host_mem else (None, "")
    if host is None and gpu is not None:  # the machines that carry this card: hardware.GPUS
        host = gpu.host_bytes * req.gpus
        host_source = (f"the default for {gpu.name}: {gpu.host_gib} GiB per GPU, as on {gpu.host_source}; "
                       "--host-mem to change")
    for name in ("bandwidth", "inter_node_bandwidth", "peak_tflops"):
        if getattr(req, name) is not None and getattr(req, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(req, name)}")
    if not 0 <= req.margin < 1:
        raise UserError(f"--margin is a share of GPU memory kept free, in [0, 1); got {req.margin}")
    target = Target(req.gpus, req.nodes, memory, gpu, req.peak_tflops, req.bandwidth, host_bytes=host,
                    margin=req.margin, host_source=host_source)
    if req.inter_node_bandwidth:
        target.inter_node_gbs = req.inter_node_bandwidth
    return target


def check_plan(req: PlanRequest, cfg: RunConfig):
    """(target, model config, where it came from), or the refusal: the target's, then what train's
    check refuses of the model's config and tokenizer (`check.run`), with the same line."""
    from shardtune.check.run import check_config

    target = target_from_request(req)
    refuse_unpriced(cfg, target)
    if cfg.float8 != "none" and target.gpu is not None and not target.gpu.supports("fp8"):
        raise UserError(f"{float8_needs(cfg.float8)}; {target.gpu.name} has none: set float8=none, or plan for "
                        "one of those")
    hf_config, source = resolve_hf_config(cfg)
    check_config(cfg, hf_config)
    return target, hf_config, source


def run_plan(req: PlanRequest, cfg: RunConfig, recipe: str | None, overrides: list[str]) -> int:
    target, hf_config, source = check_plan(req, cfg)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if req.json else \
        (lambda text: print(text, flush=True))
    say(f"model config: {source}")
    cache = TraceCache.default()
    ranked = search(cfg, hf_config, target, say, cache)
    best = confirm([e for e in ranked if e.fits], cfg, hf_config, target, cache)
    ranked = [e for e in ranked if e is not best and not _same(e, best)]
    answer = {"target": _target_json(target), "model_config_source": source,
              "best": _json(best, cfg, target, recipe, overrides) if best else None,
              "others": [_json(e, cfg, target, recipe, overrides) for e in ranked]}
    if best is None:
        answer["what_would_fit"] = what_would_fit(cfg, hf_config, target, ranked, cache)
    else:
        answer["best"]["largest_micro_batch"] = largest_micro_batch(best, cfg, hf_config, target, cache=cache)
        answer["best"]["float8_alternatives"] = float8_alternatives(cfg, hf_config, target, best)
    if cache.folder is not None:
        say(f"traced steps: {cache.misses} traced, {cache.hits} read from {cache.folder} ($SHARDTUNE_PLAN_CACHE)")
    if req.json:
        print(json.dumps(answer, indent=1))
    else:
        print(render(answer))
    return 0


LARGEST_PRICED = 2 ** 13  # largest_micro_batch prices powers of two up to this one


def largest_micro_batch(est: Estimate, cfg: RunConfig, hf_config, target: Target, limit: int = LARGEST_PRICED,
                        cache: TraceCache | None = None) -> int:
    """The largest power-of-two micro-batch of `est`'s layout that fits: at the recipe's global batch
    where it divides (what a run of it holds), else at any global batch that takes it (accumulation 2
    and more hold the second micro-step's gradients, which one micro-step does not). Priced at
    accumulation 2 throughout, it fell below the best's own micro-batch where that fits at 1; the
    best's own is priced too (a recipe's 6 that fits, where 8 does not, was answered with 4)."""
    c = est.candidate
    at = est.at or screen(layout_cfg(cfg, c, target), hf_config, target, cache=cache)
    best = 0
    kept = cfg.train.global_batch_size
    for mb in sorted({2 ** i for i in range(limit.bit_length())} | {min(c.micro_batch, limit)}):
        big = copy.deepcopy(cfg)
        big.train.global_batch_size = kept if kept % (mb * target.world) == 0 else 2 * mb * target.world
        if not estimate(at(mb), hf_config, dataclasses.replace(c, micro_batch=mb), big, target).fits:
            break
        best = mb
    return best


def _same(e: Estimate, best: Estimate | None) -> bool:
    return best is not None and e.candidate == best.candidate


def command_line(est: Estimate, cfg: RunConfig, target: Target, recipe: str | None, overrides: list[str]) -> str:
    """`shardtune train RECIPE key=value ...` for this candidate, keeping the user's overrides."""
    changes = est.candidate.settings(target)
    keys = {o.split("=", 1)[0] for o in overrides}
    words = [o for o in overrides if o.split("=", 1)[0] not in changes] + \
        [_word(k, v) for k, v in changes.items() if v != setting(cfg, k) or k in keys]
    head = ["shardtune", "train", *([recipe] if recipe else [])]
    if target.nodes == 1:
        return shlex.join([*head, *words, "--nproc", str(target.gpus_per_node)])
    # the endpoint is left for the shell to expand ($HEAD: the first node's host, as in README's
    # multi-node line); quoted as the other words are, it reached torchrun as the text "$HEAD"
    return " ".join([shlex.join(["torchrun", "--nnodes", str(target.nodes), "--nproc_per_node",
                                 str(target.gpus_per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint"]),
                     '"$HEAD:29500"', shlex.join(["-m", *head, *words])])


def _json(est: Estimate, cfg, target, recipe, overrides) -> dict:
    out = {"candidate": dataclasses.asdict(est.candidate), "fits": est.fits, "why_not": est.why_not or None,
           "accumulation": est.accumulation, "traced_whole": est.exact}
    if est.memory:
        out["gpu_bytes"] = {k: v for k, v in est.memory.items() if k != "phase"}
        out["peak_phase"] = " / ".join(str(p) for p in est.memory["phase"])
        out["host_bytes"] = est.host
        out["step_seconds"], out["tokens_per_s"] = est.step_seconds, est.tokens_per_s
        out["seconds_by_part"] = est.seconds
    if est.fits:
        out["command"] = command_line(est, cfg, target, recipe, overrides)
    return out


def float8_alternatives(cfg: RunConfig, hf_config, target: Target, best: Estimate) -> list[dict]:
    """What float8 would make of the best layout's speed on a card with float8 units, for a recipe
    that leaves it off (compiled, unless the layout offloads activations, which compile refuses).
    The search does not switch it on itself: float8 rounds every matmul's operands, a numerical
    choice left to the user; these lines say what it would give."""
    from shardtune.distributed.fsdp import detect_block_class
    from shardtune.model import float8
    from shardtune.model.hf import build_meta_model
    from shardtune.plan.cost import compiled, gpu_memory, step_time

    if cfg.float8 != "none" or cfg.peft.adapter or best.candidate.precision != "bf16" or best.trace is None \
            or target.gpu is None or not target.gpu.supports("fp8") or importlib.util.find_spec("torchao") is None:
        return []
    out = []
    for recipe in float8.RECIPES:
        model = build_meta_model(hf_config, cfg.model.trust_remote_code)  # converted in place: one per recipe
        if not float8.convert(model, detect_block_class(model, cfg.fsdp.block_class), recipe):
            continue
        shapes = float8.matmul_shapes(model)
        trial = copy.deepcopy(cfg)
        trial.float8, trial.compile = recipe, not best.candidate.activation_offload  # float8's casts want it
        trace = dataclasses.replace(best.trace, params={**best.trace.params, **shapes})
        seconds = step_time(trace, hf_config, best.candidate, trial, target, best.accumulation)["total"]
        # float8's casts cache buffers of their own beside the step's (hardware.MEASURED_RESERVE): the
        # same layout may no longer fit
        memory = gpu_memory(best.trace, best.candidate.cpu_offload, target.world, best.candidate.technique(trial))
        out.append({"recipe": recipe, "tokens_per_s": best.tokens_per_s * best.step_seconds / seconds,
                    "base_tokens_per_s": best.tokens_per_s,
                    "layers": len(float8.converted(model)), "compile": trial.compile,
                    "compile_added": trial.compile and not compiled(cfg, best.candidate),
                    "memory_total": memory["total"],
                    "fits": memory["total"] <= target.memory_bytes * (1 - target.margin)})
    return out


def _target_json(t: Target) -> dict:
    return {"gpus_per_node": t.gpus_per_node, "nodes": t.nodes, "gpu": t.gpu.name if t.gpu else None,
            "gpu_memory_bytes": t.memory_bytes, "margin": t.margin, "link_gbs": t.link_gbs(),
            "pcie_gbs": t.pcie_gbs(), "host_memory_bytes": t.host_bytes, "host_memory_source": t.host_source or None}


def render(answer: dict) -> str:
    t, lines = answer["target"], []
    gpu = t["gpu"] or "GPU"
    lines.append(f"{t['nodes']} node(s) x {t['gpus_per_node']} x {gpu} ({t['gpu_memory_bytes'] / GIB:.1f} GiB each), "
                 f"keeping {100 * t['margin']:.0f} % free")
    lines.append(f"host RAM per node: {_gib(t['host_memory_bytes'])} GiB ({t['host_memory_source']}), bounding "
                 "every answer" if t["host_memory_bytes"] else
                 "host RAM per node: not bounded (no --gpu from the table): give --host-mem SIZE to bound it")
    best = answer["best"]
    if best:
        c, g, h, sec = best["candidate"], best["gpu_bytes"], best["host_bytes"], best["seconds_by_part"]
        lines += ["", f"best: {_label(c)} (accumulation {best['accumulation']}), "
                      f"predicted {best['tokens_per_s']:,.0f} tokens/s, {best['step_seconds']:.2f} s/step",
                  "  s/step: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in sec.items() if k != "total"),
                  f"per rank, at the peak ({best['peak_phase']}), traced whole:"]
        lines += [f"  {name:<24}{g['by_category'].get(key, 0) / GIB:8.2f} GiB" for key, name in ROWS]
        lines += [f"  {'peak allocated':<24}{g['allocated'] / GIB:8.2f} GiB  (+ cuBLAS workspace)",
                  f"  {'peak reserved':<24}{g['reserved'] / GIB:8.2f} GiB  (+ the allocator's reserve)",
                  f"  {'fixed overhead':<24}{g['fixed_overhead'] / GIB:8.2f} GiB  (CUDA context, NCCL buffers)",
                  f"  {'total':<24}{g['total'] / GIB:8.2f} GiB",
                  f"host RAM per node: load {h['load'] / GIB:.1f} GiB ({h['load_path']}), "
                  f"final/ save {h['save'] / GIB:.1f} GiB ({h['save_path']}), CPU offload "
                  f"{h['cpu_offload'] / GIB:.1f} GiB, offloaded activations {h['activation_offload'] / GIB:.1f} GiB"
                  + (f", async checkpoint staging {h['async_save'] / GIB:.1f} GiB" if h.get("async_save") else "")
                  + "; "
                  f"total {h['total'] / GIB:.1f} GiB" + (f" of {_gib(t['host_memory_bytes'])}"
                                                        if t["host_memory_bytes"] else ""),
                  f"largest micro-batch per GPU that fits this layout: {best['largest_micro_batch']}"
                  + (" or more (the largest priced)" if best["largest_micro_batch"] >= LARGEST_PRICED else "")
                  + " (global batch kept here; a larger one needs train.global_batch_size to be a multiple of it x "
                  "GPUs)",
                  "run it:", f"  {best['command']}"]
        lines += [float8_line(alt, t) for alt in best.get("float8_alternatives", [])]
    else:
        lines += ["", "nothing fits."]
        for text in answer.get("what_would_fit", []):
            lines.append(f"  - {text}")
    lines += _others(answer["others"], best["tokens_per_s"] if best else None)
    lines.append(f"(reserved memory calibrated on one H200 for {calibrated()}; other techniques take the widest "
                 "measured reserve of their kind: hardware.MEASURED_RESERVE)")
    return "\n".join(lines)


def _gib(size: int) -> str:
    """A host budget in GiB, whole where that says it (--host-mem 100MB was 'host RAM per node: 0 GiB')."""
    return f"{size / GIB:.0f}" if size >= 10 * GIB else f"{size / GIB:.2g}"


def float8_line(alt: dict, t: dict) -> str:
    """The answer's line for one of `float8_alternatives` on the target `t` (its JSON)."""
    keys = f"float8={alt['recipe']}" + (" compile=true" if alt["compile"] else "")
    if not alt["fits"]:
        return (f"  with {keys}: does not fit this layout (needs {alt['memory_total'] / GIB:.1f} GiB of "
                f"{t['gpu_memory_bytes'] * (1 - t['margin']) / GIB:.1f} GiB: float8's casts keep buffers of their "
                f"own); plan with {keys} for a layout that fits")
    gain = alt["tokens_per_s"] / alt["base_tokens_per_s"] - 1
    return (f"  with {keys} ({alt['layers']} linear layers in float8; it changes the numerics, so it is yours to "
            f"choose): ~{alt['tokens_per_s']:,.0f} tokens/s ({gain:+.0%}, from torchao's published gains"
            + (" and the compile gain measured on an H200)" if alt["compile_added"] else ")"))


def _others(others: list[dict], best_tokens_per_s: float | None = None, shown_fitting: int = 10) -> list[str]:
    """Per traced layout its fastest variant that fits (a tie where within 1 % of the best: the
    tie-breaks chose the best), else the shortfall of its leanest; the layouts not traced, counted by reason."""
    fitting, dropped, untraced, seen = [], [], {}, set()
    for e in sorted(others, key=lambda e: (not e["fits"], -e.get("tokens_per_s", 0) if e["fits"]
                                           else e.get("gpu_bytes", {}).get("total", 0))):
        c = e["candidate"]
        layout = tuple(v for k, v in c.items() if k not in ("micro_batch", "optimizer_state", "cpu_offload"))
        if layout in seen:
            continue
        seen.add(layout)
        if e["fits"]:
            tie = best_tokens_per_s is not None and e["tokens_per_s"] >= best_tokens_per_s * (1 - TIE)
            fitting.append(f"  fits, {'a tie (within 1 %)' if tie else 'slower'}: {_label(c)}: "
                           f"{e['tokens_per_s']:,.0f} tokens/s")
        elif e["why_not"].startswith("not traced: "):
            kind = "slower at best than" if "tokens/s if it fit" in e["why_not"] else "heavier than"
            untraced.setdefault(kind, []).append(e)
        else:
            dropped.append(f"  dropped: {_label(c)}: {e['why_not']}")
    lines = ["", "other layouts (their fastest that fits, or why dropped):"] if others else []
    lines += fitting[:shown_fitting] + ([f"  ... and {len(fitting) - shown_fitting} more that fit, slower"]
                                        if len(fitting) > shown_fitting else [])
    lines += dropped
    for kind, group in untraced.items():
        lines.append(f"  not traced: {len(group)} layout(s) {kind} what was found, e.g. "
                     f"{_label(group[0]['candidate'], batch=False)}: {group[0]['why_not'][len('not traced: '):]}")
    return lines


def _label(c: dict, batch: bool = True) -> str:
    text = Candidate(**c).label()
    return text if batch else text.rsplit(", micro-batch", 1)[0]


def what_would_fit(cfg: RunConfig, hf_config, target: Target, ranked: list[Estimate],
                   cache: TraceCache | None = None) -> list[str]:
    """When nothing fits: the smallest change that would, each with its predicted memory."""
    budget = target.memory_bytes * (1 - target.margin)
    smallest = min((x.candidate.micro_batch for x in ranked if x.memory), default=None)  # None: nothing traced
    tried = [e for e in ranked if e.memory and e.candidate.micro_batch == smallest]
    out = []
    lean = min(tried, key=lambda e: e.memory["total"]) if tried else None
    if lean is not None:
        # sharded states shrink with the number of ranks; the rest does not
        cats = lean.memory["by_category"]
        sharded = sum(cats.get(k, 0) for k in STATES)  # the allocator reserves nothing beside them
        fixed = lean.memory["total"] - sharded
        for world in range(target.world + 1, 1025):
            if fixed + sharded * target.world / world <= budget:
                out.append(f"more GPUs: {world} of them ({_label(dataclasses.asdict(lean.candidate))}) need about "
                           f"{(fixed + sharded * target.world / world) / GIB:.1f} GiB each")
                break
    if not cfg.peft.low_rank:
        out += _lora_lines(cfg, hf_config, target, cache)
    if lean is not None:
        acts = sum(lean.memory["by_category"].get(k, 0) for k in ("activations", "temporaries"))
        seq = cfg.data.seq_len
        while seq > 64 and lean.memory["total"] - acts * (1 - seq / cfg.data.seq_len) > budget:
            seq //= 2
        if seq < cfg.data.seq_len and lean.memory["total"] - acts * (1 - seq / cfg.data.seq_len) <= budget:
            out.append(f"a shorter sequence: data.seq_len={seq} needs about "
                       f"{(lean.memory['total'] - acts * (1 - seq / cfg.data.seq_len)) / GIB:.1f} GiB "
                       f"({_label(dataclasses.asdict(lean.candidate))})")
    return out


def _lora_lines(cfg: RunConfig, hf_config, target: Target, cache: TraceCache | None = None) -> list[str]:
    """What LoRA (traced) and, on one GPU, QLoRA (the LoRA trace with its base priced in NF4:
    plan.qlora) would need per rank, each with the keys that run it: those its priced layout changes
    (the card's precision; float8, which train refuses beside an adapter)."""
    from shardtune.plan.menu import precisions
    from shardtune.plan.search import estimate, screen, traced

    lora = copy.deepcopy(cfg)
    lora.peft = type(cfg.peft)(method="lora")  # LoRA's defaults, nothing of another method's settings
    lora.freeze, lora.float8 = type(cfg.freeze)(), "none"
    cand = Candidate("full_shard", precisions(cfg, target)[0], 1, "full")
    layout = cand.apply(lora, target)
    at = traced(lambda: screen(layout, hf_config, target, cache=cache))
    if isinstance(at, str):
        return [f"LoRA: {at}"]
    est = estimate(at(1), hf_config, cand, layout, target)
    out = [f"LoRA ({_changed(cfg, layout)}): {est.memory['total'] / GIB:.1f} GiB per rank "
           f"({'fits' if est.fits else 'does not fit'})"]
    one = dataclasses.replace(target, gpus_per_node=1, nodes=1)
    if cfg.model.name_or_path is None or cfg.model.random_init or \
            (target.gpu is not None and not target.gpu.supports("bf16")):
        return out  # QLoRA quantizes pretrained weights and computes in bf16
    qlora = copy.deepcopy(layout)
    qlora.peft.quantize, qlora.precision = "4bit", "bf16"
    cand = dataclasses.replace(cand, precision="bf16")
    at = traced(lambda: screen(cand.apply(qlora, one), hf_config, one, cache=cache))
    if isinstance(at, str):
        return out + [f"QLoRA: {at}"]
    est = estimate(at(1), hf_config, cand, cand.apply(qlora, one), one)
    return out + [f"QLoRA ({_changed(cfg, cand.apply(qlora, one))}, one GPU): {est.memory['total'] / GIB:.1f} GiB "
                  f"({'fits' if est.fits else 'does not fit'}; the LoRA trace, its base priced in NF4)"]


def _changed(cfg: RunConfig, other: RunConfig) -> str:
    """The key=value words that make `cfg` the run `other` (the keys a suggestion changes)."""
    from shardtune.plan.trace_cache import traced_keys

    old = traced_keys(cfg)
    return " ".join(_word(k, v) for k, v in traced_keys(other).items() if v != old[k])


def _word(key: str, value) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"
