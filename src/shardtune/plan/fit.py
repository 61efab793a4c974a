"""Where the planner finds a model's transformers config without the network, and what one
config needs on its own device (the fit checks of `train`/`sweep`: the predicted peak, the
largest micro-batch that fits, for train.micro_batch_size=auto)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from shardtune.config.schema import ModelConfig, RunConfig
from shardtune.errors import UserError

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"




def resolve_hf_config(cfg: RunConfig):
    """(transformers config, where it came from), without the network: model.config, a local
    folder, the Hugging Face cache, or a config shipped with shardtune for the recipes' models."""
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
    if Path(m.name_or_path).is_dir():
        return load_hf_config(m), f"local folder {m.name_or_path}"
    try:
        return load_hf_config(m, local_files_only=True), "the Hugging Face cache"
    except UserError:
        pass
    shipped = SHIPPED_CONFIGS / f"{m.name_or_path.replace('/', '--')}.json"
    if shipped.is_file():
        whole = {**json.loads(shipped.read_text()), **m.config}
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


def auto_micro_batches(global_batch: int, world_size: int) -> list[int]:
    """The micro-batches that keep the global batch on `world_size` ranks: the divisors of
    global batch / ranks; a one-line error where the ranks do not divide it."""
    per_rank, rest = divmod(global_batch, world_size)
    if rest or not per_rank:
        raise UserError(f"train.micro_batch_size=auto keeps train.global_batch_size={global_batch}, which "
                        f"{world_size} ranks do not divide; set the global batch to a multiple of {world_size}")
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def resolve_auto(cfg: RunConfig, world_size: int, local_world_size: int, host_budget: int | None = None) \
        -> tuple[int, str]:
    """(micro-batch, start-up line) for train.micro_batch_size=auto: the largest that keeps the
    global batch and that the planner predicts fits this device for the configured layout. On
    CUDA: this GPU's memory (5 % kept free, CUDA's overheads counted, as `plan`). On CPU the
    tensors live in host RAM: the available RAM shared by this node's ranks (`host_budget` per
    rank where given, e.g. sweep --mem-limit), 20 % and 1 GiB per rank kept for everything else."""
    import dataclasses

    from shardtune.hardware import GIB, gpu_by_device_name
    from shardtune.plan.cost import Candidate, Target
    from shardtune.plan.search import estimate, screen
    from shardtune.plan.trace import trace_step

    sizes = auto_micro_batches(cfg.train.global_batch_size, world_size)
    hf_config, _ = resolve_hf_config(cfg)
    device = trace_target(cfg)
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        target = Target(local_world_size, max(1, world_size // local_world_size), props.total_memory,
                        gpu_by_device_name(props.name))
        budget = target.memory_bytes * (1 - target.margin)
        where = f"this GPU ({props.name}, {props.total_memory / GIB:.1f} GiB, 5 % kept free)"
        layout = Candidate(cfg.fsdp.sharding, cfg.precision, 1, cfg.activation_checkpointing,
                           cfg.activation_checkpointing_every, cfg.activation_offload, cfg.fsdp.reduce_dtype,
                           cfg.train.optimizer_state, cfg.fsdp.cpu_offload)

        def need(trace, mb) -> int:
            run = dataclasses.replace(layout, micro_batch=mb).apply(cfg)
            return estimate(trace, hf_config, dataclasses.replace(layout, micro_batch=mb), run, target).memory["total"]
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

        def need(trace, mb) -> int:
            return trace.peak_bytes()
    first = copy.deepcopy(cfg)
    first.train.micro_batch_size = 1
    at = screen(first, hf_config, target, device)
    fitting = [mb for mb in sizes if need(at(mb), mb) <= budget]
    for mb in reversed(fitting):  # the extrapolated choice, confirmed by a whole trace
        run = copy.deepcopy(cfg)
        run.train.micro_batch_size = mb
        peak = need(trace_step(run, hf_config, world_size, local_world_size, target=device), mb)
        if peak <= budget:
            accum = cfg.train.global_batch_size // (mb * world_size)
            return mb, (f"train.micro_batch_size=auto: {mb} per rank, the largest that fits {where} "
                        f"(predicted {peak / GIB:.2f} GiB of {budget / GIB:.2f} GiB); gradient accumulation {accum} "
                        f"keeps the global batch of {cfg.train.global_batch_size}")
    raise UserError(f"train.micro_batch_size=auto: not even 1 sequence per rank fits {where} (needs "
                    f"{need(at(1), 1) / GIB:.2f} GiB of {budget / GIB:.2f} GiB); run `shardtune plan` for a layout "
                    "that fits, or use more ranks")


def available_host_bytes() -> int:
    """Host RAM available to new allocations (Linux's MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
