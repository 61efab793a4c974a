"""Where the planner finds a model's transformers config without the network, and what one
config needs on its own device (the fit checks of `train`/`sweep`: the predicted peak, the
largest micro-batch that fits, for train.micro_batch_size=auto)."""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.config.load import auto_micro_batches
from shardtune.config.schema import ModelConfig, RunConfig
from shardtune.errors import UserError
from shardtune.fsio import json_loads
from shardtune.plan.menu import checkpointing_modes

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"




def resolve_hf_config(cfg: RunConfig):
    """(transformers config, where it came from), without the network: model.config, a local
    folder, the Hugging Face cache, or a config shipped with shardtune for the recipes' models."""
    from shardtune.model.files import check_model_source
    from shardtune.model.hf import load_hf_config

    m = cfg.model
    if m.name_or_path is None:  # as train builds it: the vocabulary of its tokenizer, where that is at hand
        from shardtune.model.hf import load_tokenizer, match_tokenizer

        hf_config = load_hf_config(m)
        try:
            match_tokenizer(hf_config, load_tokenizer(m), m)
        except UserError:
            return hf_config, "model.config (tokenizer not at hand: the config's vocabulary)"
        return hf_config, "model.config"
    if Path(m.name_or_path).is_dir():  # its config.json: no weights needed to plan
        return load_hf_config(m, weights=False), f"local folder {m.name_or_path}"
    check_model_source(m.name_or_path, "model.name_or_path")  # train's line, not "not available offline"
    try:
        return load_hf_config(m, local_files_only=True), "the Hugging Face cache"
    except UserError:
        pass
    shipped = SHIPPED_CONFIGS / f"{m.name_or_path.replace('/', '--')}.json"
    if shipped.is_file():
        whole = {**json_loads(shipped.read_text()), **m.config}
        local = ModelConfig(config=whole, trust_remote_code=m.trust_remote_code)
        return load_hf_config(local), f"the copy of its config.json shipped with shardtune ({shipped.name})"
    raise UserError(f"the config of model {m.name_or_path!r} is not available offline (not a local folder, not in "
                    f"the Hugging Face cache); run `shardtune download model:{m.name_or_path}` where there is "
                    "network, or give model.config={model_type: ..., ...}")


def trace_target(cfg: RunConfig) -> str:
    """'cuda' where the run would use a GPU (device=cuda, or auto with one visible), else 'cpu'."""
    if cfg.device == "auto":

        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def predict_peak_bytes(cfg: RunConfig, world_size: int) -> int:
    """Predicted peak bytes of live tensors on one rank for exactly this config on its device:
    on CPU the traced peak; on CUDA the traced peak of GPU-resident tensors plus the cuBLAS
    workspace (what torch.cuda.max_memory_allocated would report). For sweep's max-batch search."""
    from shardtune.plan.trace import trace_step

    hf_config, _ = resolve_hf_config(cfg)
    target = trace_target(cfg)
    trace = trace_step(cfg, hf_config, world_size, target=target)
    if target == "cpu":
        return trace.peak_bytes()
    from shardtune.plan.cost import gpu_memory

    return gpu_memory(trace, cfg.fsdp.cpu_offload, world_size)["allocated"]


# ----------------------------------------------------------------------------- micro_batch_size=auto

HOST_KEEP_FREE = 0.2  # share of available host RAM auto leaves free on CPU (page cache, data workers)
HOST_PROCESS_BYTES = 1 << 30  # what a rank's interpreter, torch and transformers hold beside tensors


def resolve_layout(cfg: RunConfig, world_size: int, local_world_size: int, host_budget: int | None = None) \
        -> tuple[int, str, str]:
    """(micro-batch, activation checkpointing, start-up line) for train.micro_batch_size=auto and/or
    activation_checkpointing=auto: of the pairs that keep the global batch, the one the planner
    predicts fastest (cost.step_time: recomputation costs, fewer accumulation steps save
    communication) among those it predicts fit this device for the configured layout; within 1 %
    the least recomputation, then the larger micro-batch. On CUDA: this GPU's memory (5 % kept
    free, CUDA's overheads counted, as `plan`). On CPU the tensors live in host RAM: the available
    RAM shared by this node's ranks (`host_budget` per rank where given, e.g. sweep --mem-limit),
    20 % and 1 GiB per rank kept for everything else."""
    from shardtune.hardware import GIB, gpu_by_device_name
    from shardtune.plan.cost import Candidate, Target
    from shardtune.plan.search import estimate, screen

    auto_mb, auto_ck = cfg.train.micro_batch_size == "auto", cfg.activation_checkpointing == "auto"
    sizes = auto_micro_batches(cfg.train.global_batch_size, world_size) if auto_mb else [cfg.train.micro_batch_size]
    modes = checkpointing_modes(cfg) if auto_ck else (cfg.activation_checkpointing,)
    hf_config, _ = resolve_hf_config(cfg)
    device = trace_target(cfg)
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        target = Target(local_world_size, max(1, world_size // local_world_size), props.total_memory,
                        gpu_by_device_name(props.name))
        budget = target.memory_bytes * (1 - target.margin)
        where = f"this GPU ({props.name}, {props.total_memory / GIB:.1f} GiB, 5 % kept free)"
    else:
        target = Target(local_world_size, max(1, world_size // local_world_size), 0, None)
        if host_budget is None:
            available = available_host_bytes()
            host_budget = int(available * (1 - HOST_KEEP_FREE) / local_world_size) - HOST_PROCESS_BYTES
            where = (f"host RAM ({available / GIB:.1f} GiB available over {local_world_size} rank(s), 20 % and 1 GiB "
                     "per rank kept free)")
        else:
            where = f"the memory limit of {host_budget / GIB:.1f} GiB per rank"
        budget = host_budget

    def candidate(mode: str, mb: int) -> Candidate:
        return Candidate(cfg.fsdp.sharding, cfg.precision, mb, mode, cfg.activation_checkpointing_every,
                         cfg.activation_offload, cfg.fsdp.reduce_dtype, cfg.train.optimizer_state, cfg.fsdp.cpu_offload)

    def run_of(mode: str, mb: int) -> RunConfig:
        run = copy.deepcopy(cfg)
        run.activation_checkpointing, run.train.micro_batch_size = mode, mb
        run.kernels = "none"  # Liger's Triton kernels do not run on the trace's fake tensors: the chunked path's
        return run

    def priced(trace, mode: str, mb: int) -> tuple[int, float]:
        """(predicted bytes on the device, predicted tokens/s) of `mode` at `mb` from its trace."""
        est = estimate(trace, hf_config, candidate(mode, mb), run_of(mode, mb), target)
        return (est.memory["total"] if device == "cuda" else trace.peak_bytes()), est.tokens_per_s

    from shardtune.plan.trace import trace_step

    chosen = choose_layout(modes, sizes, lambda mode: screen(run_of(mode, 1), hf_config, target, device),
                           priced, budget,
                           lambda mode, mb: trace_step(run_of(mode, mb), hf_config, world_size, local_world_size,
                                                       target=device))
    names = " and ".join(n for n, on in (("train.micro_batch_size=auto", auto_mb),
                                         ("activation_checkpointing=auto", auto_ck)) if on)
    mode, mb = chosen.mode, chosen.micro_batch
    if not chosen.fits:
        what = f"activation checkpointing {mode} at micro-batch {mb}" if auto_ck else f"{mb} sequence per rank"
        raise UserError(f"{names}: not even {what} fits {where} (needs {chosen.need / GIB:.2f} GiB of "
                        f"{budget / GIB:.2f} GiB); run `shardtune plan` for a layout that fits, or use more ranks")
    accum = cfg.train.global_batch_size // (mb * world_size)
    said = ([f"train.micro_batch_size=auto: {mb} per rank"] if auto_mb else []) + \
        ([f"activation_checkpointing=auto: {mode}"] if auto_ck else [])
    which = "the fastest predicted that fits" if auto_ck else "the largest that fits"
    line = (f"{', '.join(said)}, {which} {where} (predicted {chosen.need / GIB:.2f} GiB of {budget / GIB:.2f} GiB"
            f"{f', {chosen.tokens_per_s:,.0f} tokens/s' if auto_ck and device == 'cuda' else ''})")
    if auto_ck and chosen.need_none is not None:
        line += f"; without checkpointing it needs {chosen.need_none / GIB:.2f} GiB at micro-batch {sizes[0]}"
    if cfg.kernels != "none":
        line += f"; traced without kernels={cfg.kernels} (HF's modules and the chunked head loss)"
    return mb, mode, line + f"; gradient accumulation {accum} keeps the global batch of {cfg.train.global_batch_size}"


@dataclass
class Choice:
    """resolve_layout's answer: the pair chosen, or (fits False) the lightest that did not fit."""
    mode: str
    micro_batch: int
    need: int  # predicted bytes on the device
    tokens_per_s: float
    fits: bool
    need_none: int | None = None  # a checkpointing mode chosen: the bytes without it at the smallest micro-batch


def choose_layout(modes, sizes, screened, priced, budget: float, whole) -> Choice:
    """The fastest (mode, micro-batch) that fits `budget`. `screened(mode)` is a function
    micro-batch -> extrapolated trace; `priced(trace, mode, mb)` its (bytes, tokens/s); `whole(mode,
    mb)` the full trace that confirms a choice. Modes are traced only where needed: the speed model
    reads the parameter counts only, so every pair's speed is known from the first trace; where the
    lightest mode at the smallest micro-batch does not fit, nothing does, and nothing else is traced."""
    from shardtune.plan.cost import CHECKPOINTING
    from shardtune.plan.search import TIE

    traces = {}

    def price(mode, mb):
        if mode not in traces:
            traces[mode] = screened(mode)
        return priced(traces[mode](mb), mode, mb)

    first = screened(modes[0])
    traces[modes[0]] = first
    speeds = {(mode, mb): priced(first(mb), mode, mb)[1] for mode in modes for mb in sizes}
    top = max(speeds.values())
    # speeds within TIE of each other tie: the least recomputation, then the larger micro-batch (one
    # mode: the largest micro-batch that fits, as micro_batch_size=auto has always chosen)
    order = sorted(speeds, key=lambda p: (-round(math.log(speeds[p] / top) / TIE) if len(modes) > 1 else 0,
                                          CHECKPOINTING.index(p[0]), -p[1]))
    lightest = min(modes, key=CHECKPOINTING[::-1].index)
    light = None
    for mode, mb in order:
        need, speed = price(mode, mb)
        if need > budget:
            light = light or price(lightest, sizes[0])[0]
            if light > budget:  # nothing needs less: refuse without tracing the rest
                return Choice(lightest, sizes[0], light, 0.0, False)
            continue
        need = priced(whole(mode, mb), mode, mb)[0]  # the extrapolated choice, confirmed by a whole trace
        if need <= budget:
            need_none = price("none", sizes[0])[0] if mode != "none" and "none" in modes else None
            return Choice(mode, mb, need, speed, True, need_none)
    return Choice(lightest, sizes[0], price(lightest, sizes[0])[0], 0.0, False)


def available_host_bytes() -> int:
    """Host RAM available to new allocations: Linux's MemAvailable (else the free pages), or less where
    this process's memory cgroup (a Slurm job's --mem, a container's limit) leaves less: the machine's
    free RAM is not the job's, and a rank planned by it was killed by the cgroup's OOM killer."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = cgroup_headroom()
    return free if headroom is None else min(free, headroom)


def cgroup_headroom(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroup and each above it still allow, the least of them: its limit
    less its usage, the inactive file cache counted free (the kernel reclaims it before an OOM kill);
    None where no limit is set or readable. cgroup v2 (memory.max) and v1 (memory.limit_in_bytes); a
    container sees its own cgroup at the mount's root, where /proc/self/cgroup names the host's path."""
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        return None
    least = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            mount, limit_file, usage_file, stat_key = Path(root), "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            mount, limit_file = Path(root) / "memory", "memory.limit_in_bytes"
            usage_file, stat_key = "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        here = mount / path.lstrip("/")
        folder = here if here.is_dir() else mount
        while True:
            room = _room(folder, limit_file, usage_file, stat_key)
            if room is not None:
                least = room if least is None else min(least, room)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return least


UNLIMITED = 2 ** 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _room(folder: Path, limit_file: str, usage_file: str, stat_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= UNLIMITED:
            return None
        usage = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - usage + int(stat.get(stat_key, 0)))
