"""`shardtune plan`: each rank's memory before the run, and the fastest configuration that fits.

Memory comes from a traced training step (memtrace.py): the truth for everything a trace can
see. A GPU adds what it cannot (hardware.CUDA_OVERHEADS). The search traces every candidate
layout (sharding x activation checkpointing x CPU offload x precision) on a 3- and a 4-block copy
of the model at micro-batches 1 and 2, extrapolates to the model's depth and to each
micro-batch, ranks what fits by predicted throughput, and traces the winner whole to confirm it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardtune.config.load import check_world
from shardtune.config.schema import ModelConfig, RunConfig
from shardtune.errors import UserError
from shardtune.hardware import GIB, GPU, HOST_FACTS, overhead
from shardtune.plan.trace import OFFLOADED, StepTrace

SCREEN_DEPTHS = (3, 4)  # blocks in the copies the search traces; the phase peaks are linear beyond 2
SCREEN_MICRO = (2, 4)  # micro-batches traced; where a peak sits inside a block settles by about 2
SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"


def resolve_hf_config(cfg: RunConfig):
    """(transformers config, where it came from), without the network: model.config, a local
    folder, the Hugging Face cache, or a config shipped with shardtune for the recipes' models."""
    from shardtune.model.hf import load_hf_config, not_a_folder

    m = cfg.model
    if m.name_or_path is None:  # as train builds it: the vocabulary of its tokenizer, where that is at hand
        from shardtune.model.hf import load_tokenizer, match_tokenizer

        hf_config = load_hf_config(m)
        try:
            match_tokenizer(hf_config, load_tokenizer(m), m)
        except UserError:
            return hf_config, "model.config (tokenizer not at hand: the config's vocabulary)"
        return hf_config, "model.config"
    not_a_folder(Path(m.name_or_path), "model.name_or_path")
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
    return gpu_memory(trace, cfg.fsdp.cpu_offload, world_size)["allocated"]


def gpu_memory(trace: StepTrace, offload: bool, world_size: int) -> dict:
    """One CUDA rank's memory from a trace: the peak of what stays on the GPU, by category, then
    allocated (+ cuBLAS workspace), reserved (+ fragmentation) and the fixed overhead outside
    torch's allocator (CUDA context, NCCL buffers), and their sum, what nvidia-smi would show."""
    leave_out = OFFLOADED if offload else ()
    phase, cats = trace.peak(leave_out)
    on_gpu = {k: v for k, v in cats.items() if k not in leave_out}
    allocated = sum(on_gpu.values()) + int(overhead("cublas_workspace"))
    reserved = int(allocated * (1 + overhead("fragmentation")))
    nccl = int(overhead("nccl_buffers") * overhead("nccl_channels") * 2) if world_size > 1 else 0
    fixed = int(overhead("cuda_context")) + nccl
    return {"phase": phase, "by_category": on_gpu, "allocated": allocated, "reserved": reserved,
            "fixed_overhead": fixed, "total": reserved + fixed}


def host_memory(trace: StepTrace, offload: bool, ranks_per_node: int) -> dict:
    """Host RAM of one node: rank 0 reads the full fp32 weights once (then hands out shards),
    export gathers the full fp32 model to rank 0, CPU offload keeps every rank's shards."""
    full_fp32 = 4 * trace.params["total"]
    offloaded = ranks_per_node * sum(trace.steady.get(c, 0) for c in OFFLOADED) if offload else 0
    return {"rank0_load": full_fp32, "export": full_fp32, "cpu_offload": offloaded,
            "total": max(full_fp32, full_fp32) + offloaded}


@dataclass
class Target:
    """The machine asked about."""
    gpus_per_node: int
    nodes: int
    memory_bytes: int
    gpu: GPU | None  # None: only --gpu-mem was given
    peak_tflops: float | None = None  # overrides the table (needed without --gpu for a speed estimate)
    bandwidth_gbs: float | None = None  # overrides the GPU's intra-node link
    inter_node_gbs: float = HOST_FACTS["inter_node_gbs"].value
    host_bytes: int | None = None
    margin: float = 0.05  # share of GPU memory kept free

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak_flops(self, precision: str) -> float:
        if self.peak_tflops:
            return self.peak_tflops * 1e12
        if self.gpu is not None:
            return self.gpu.peak_flops(precision)
        return {"bf16": 100e12, "fp16": 100e12, "fp32": 15e12}[precision]  # a nominal card: ranks still hold

    def link_gbs(self) -> float:
        intra = self.bandwidth_gbs or (self.gpu.link_gbs if self.gpu else 24.0)
        return intra if self.nodes == 1 else min(intra, self.inter_node_gbs)


@dataclass
class Candidate:
    sharding: str
    activation_checkpointing: bool
    cpu_offload: bool
    precision: str
    micro_batch: int

    def apply(self, cfg: RunConfig) -> RunConfig:
        out = copy.deepcopy(cfg)
        out.fsdp.sharding, out.activation_checkpointing = self.sharding, self.activation_checkpointing
        out.fsdp.cpu_offload, out.precision = self.cpu_offload, self.precision
        out.train.micro_batch_size = self.micro_batch
        return out

    def label(self) -> str:
        return (f"{self.sharding}, {self.precision}, checkpointing {'on' if self.activation_checkpointing else 'off'}"
                f", offload {'on' if self.cpu_offload else 'off'}, micro-batch {self.micro_batch}")


@dataclass
class Estimate:
    candidate: Candidate
    memory: dict  # gpu_memory()
    host: dict  # host_memory()
    step_seconds: float
    tokens_per_s: float
    accumulation: int
    fits: bool
    why_not: str = ""
    exact: bool = False  # traced whole (else extrapolated from the small copies)
    trace: StepTrace | None = field(default=None, repr=False)
    at: object = field(default=None, repr=False)  # micro-batch -> StepTrace of this layout (screen())


def step_time(trace: StepTrace, hf_config, cand: Candidate, cfg: RunConfig, target: Target, accum: int) -> float:
    """Seconds per optimizer step: compute at an assumed MFU, communication overlapped with it
    (FSDP prefetches), offload copies and the CPU optimizer not overlapped."""
    from shardtune.telemetry.metrics import flops_per_token

    p, seq, world = trace.params, cfg.data.seq_len, target.world
    tokens = cand.micro_batch * accum * seq  # per rank per step
    fpt = flops_per_token(p["matmul"], hf_config, seq, p["matmul_trainable"])
    if cand.activation_checkpointing:
        fpt += 2.0 * p["matmul"]  # the blocks' forward runs again in backward
    compute = tokens * fpt / (target.peak_flops(cand.precision) * HOST_FACTS["mfu"].value)
    dtype_bytes = 4 if cand.precision == "fp32" else 2
    gathered, grads = p["total"] * dtype_bytes, p["trainable"] * 4  # reductions are fp32
    shard_group = 1 if cand.sharding == "no_shard" else (target.gpus_per_node if cand.sharding == "hybrid_shard"
                                                         else world)
    ring = (shard_group - 1) / shard_group
    if cand.sharding in ("full_shard", "hybrid_shard") and shard_group > 1:
        volume = accum * (2 * gathered + grads) * ring  # gather for forward and backward, reduce-scatter each
    elif cand.sharding in ("shard_grad_op", "full_shard"):
        volume = accum * gathered * ring + grads * ring  # gathered once per micro-step, reduced once
    else:
        volume = 0.0
    replicas = world // shard_group
    if replicas > 1:  # all-reduce of the (sharded) gradients across replicas
        volume += 2 * grads / shard_group * (replicas - 1) / replicas
    comm = volume / (target.link_gbs() * 1e9)
    offload = 0.0
    if cand.cpu_offload:
        shard = p["total"] * 4 / shard_group
        pcie = min(HOST_FACTS["pcie_gbs"].value, target.gpu.link_gbs if target.gpu else 1e9)  # PCIe 3 cards
        offload = accum * 2 * shard / (pcie * 1e9)  # parameters in, gradients out
        offload += 28 * p["trainable"] / shard_group / (HOST_FACTS["host_adam_gbs"].value * 1e9)
    return max(compute, comm) + offload


# ----------------------------------------------------------------------------- search


def precisions(cfg: RunConfig, target: Target) -> list[str]:
    """The recipe's precision (fp16 where the card has no bf16), and a half precision beside fp32."""
    first = cfg.precision
    if target.gpu is not None and not target.gpu.supports(first):
        first = "fp16"
    half = "fp16" if target.gpu is not None and not target.gpu.supports("bf16") else "bf16"
    return [first] + ([half] if first == "fp32" else [])


def shardings(cfg: RunConfig, target: Target) -> list[str]:
    """Least memory first (full_shard <= shard_grad_op <= no_shard per rank)."""
    if target.world == 1:
        return ["full_shard"]  # one rank: all strategies are the same step
    return ["full_shard"] + (["hybrid_shard"] if target.nodes > 1 else []) + ["shard_grad_op", "no_shard"]


def micro_batches(cfg: RunConfig, world: int) -> list[int]:
    """Powers of two (and the recipe's own size) that keep the recipe's global batch (accumulation
    fills in)."""
    g = cfg.train.global_batch_size
    sizes = sorted({2 ** i for i in range(20)} | {cfg.train.micro_batch_size})
    out = [mb for mb in sizes if mb * world <= g and g % (mb * world) == 0]
    if not out:
        raise UserError(f"train.global_batch_size={g} cannot be split over {world} ranks; set it to a multiple of "
                        f"{world}")
    return out


def layout_cfg(cfg: RunConfig, sharding: str, ac: bool, precision: str, target: Target) -> RunConfig:
    out = Candidate(sharding, ac, False, precision, cfg.train.micro_batch_size).apply(cfg)
    if sharding == "hybrid_shard":
        out.fsdp.shard_size, out.fsdp.replicate_size = target.gpus_per_node, target.nodes
    return out


def screen(cfg: RunConfig, hf_config, target: Target):
    """A function micro-batch -> StepTrace of `cfg`, extrapolated from small traced copies (two
    depths x two micro-batches; the model's own depth where it cannot be extrapolated)."""
    from shardtune.plan.trace import extrapolate, layer_count, trace_step

    layers = layer_count(hf_config)
    depths = SCREEN_DEPTHS if extrapolable(cfg, layers) else (layers,)
    traces = {}
    for depth in depths:
        for mb in SCREEN_MICRO:
            small = copy.deepcopy(cfg)
            small.train.micro_batch_size, small.train.global_batch_size = mb, 2 * mb * target.world  # 2 micro-steps
            traces[(depth, mb)] = trace_step(small, hf_config, target.world, target.gpus_per_node, depth, "cuda")
    return lambda mb: extrapolate(traces, layers, mb)


def extrapolable(cfg: RunConfig, layers: int) -> bool:
    """Depth extrapolation needs one unit per block and blocks that are all alike."""
    return (layers > max(SCREEN_DEPTHS) and cfg.fsdp.wrap == "block" and cfg.freeze.trainable_blocks is None)


def estimate(trace: StepTrace, hf_config, cand: Candidate, cfg: RunConfig, target: Target) -> Estimate:
    accum = check_world(cand.apply(cfg), target.world)
    if accum == 1:  # one micro-step per step: the second one's phases do not happen
        trace = dataclasses.replace(trace, phases={k: v for k, v in trace.phases.items() if k[0] < 1})
    memory = gpu_memory(trace, cand.cpu_offload, target.world)
    host = host_memory(trace, cand.cpu_offload, target.gpus_per_node)
    seconds = step_time(trace, hf_config, cand, cfg, target, accum)
    budget = target.memory_bytes * (1 - target.margin)
    why = ""
    if memory["total"] > budget:
        why = f"needs {memory['total'] / GIB:.1f} GiB of {budget / GIB:.1f} GiB"
    elif target.host_bytes and host["total"] > target.host_bytes:
        why = f"needs {host['total'] / GIB:.1f} GiB of host RAM of {target.host_bytes / GIB:.1f} GiB"
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return Estimate(cand, memory, host, seconds, tokens / seconds, accum, not why, why, trace=trace)


def search(cfg: RunConfig, hf_config, target: Target, say=print) -> list[Estimate]:
    """Every candidate, best first: the fitting ones by predicted tokens/s, then the others."""
    estimates: list[Estimate] = []
    sizes = micro_batches(cfg, target.world)
    for precision in precisions(cfg, target):
        # shardings come least memory first, and checkpointing off needs more than on: once a
        # layout fits at no micro-batch, with or without offload, the ones after it cannot either
        misfit = {True: "", False: ""}
        for sharding in shardings(cfg, target):
            for ac in (False, True):
                if misfit[True] or misfit[ac]:
                    estimates.append(_skipped(Candidate(sharding, ac, False, precision, sizes[0]),
                                              misfit[True] or misfit[ac]))
                    continue
                if ac and any(e.fits and e.candidate.micro_batch == sizes[-1] and not e.candidate.cpu_offload
                              for e in estimates[-2 * len(sizes):]):
                    continue  # fits every micro-batch without recomputation: checkpointing only costs time
                layout = layout_cfg(cfg, sharding, ac, precision, target)
                say(f"tracing {sharding}, {precision}, activation checkpointing {'on' if ac else 'off'}")
                at = screen(layout, hf_config, target)
                batch = [estimate(at(mb), hf_config, Candidate(sharding, ac, offload, precision, mb), layout, target)
                         for offload in (False, True) for mb in sizes]
                for e in batch:
                    e.at = at
                estimates += batch
                if not any(e.fits for e in batch):
                    misfit[ac] = f"needs more memory than {sharding} with checkpointing {'on' if ac else 'off'}"
    return rank(estimates, cfg)


def largest_micro_batch(est: Estimate, cfg: RunConfig, hf_config, target: Target) -> int:
    """The largest power-of-two micro-batch of `est`'s layout that fits, whatever the global batch."""
    c = est.candidate
    at = est.at or screen(layout_cfg(cfg, c.sharding, c.activation_checkpointing, c.precision, target), hf_config,
                          target)
    best = 0
    for mb in (2 ** i for i in range(14)):
        trial = dataclasses.replace(c, micro_batch=mb)
        big = copy.deepcopy(cfg)
        big.train.global_batch_size = 2 * mb * target.world
        if not estimate(at(mb), hf_config, trial, big, target).fits:
            break
        best = mb
    return best


def _skipped(cand: Candidate, reason: str) -> Estimate:
    return Estimate(cand, {}, {}, float("inf"), 0.0, 0, False, f"not traced: {reason}, which fits nowhere")


def rank(estimates: list[Estimate], cfg: RunConfig) -> list[Estimate]:
    """Fitting first, fastest first; within 1 % of speed, the fewest changes to the recipe, then
    the larger micro-batch (better GEMM efficiency than the model counts), then the least memory."""
    def changes(c: Candidate) -> int:
        return sum([c.sharding != cfg.fsdp.sharding, c.activation_checkpointing != cfg.activation_checkpointing,
                    c.cpu_offload != cfg.fsdp.cpu_offload, c.precision != cfg.precision])
    return sorted(estimates, key=lambda e: (not e.fits, -round(math.log(max(e.tokens_per_s, 1e-9)) / 0.01),
                                            changes(e.candidate), -e.candidate.micro_batch,
                                            e.memory.get("total", 0)))


def confirm(best: list[Estimate], cfg: RunConfig, hf_config, target: Target) -> Estimate | None:
    """Trace the top candidates whole, in order, until one fits: the answer rests on a full trace."""
    from shardtune.plan.trace import trace_step

    for est in best[:3]:
        if not est.fits:
            return None
        run = est.candidate.apply(layout_cfg(cfg, est.candidate.sharding, est.candidate.activation_checkpointing,
                                             est.candidate.precision, target))
        full = trace_step(run, hf_config, target.world, target.gpus_per_node, target="cuda")
        exact = estimate(full, hf_config, est.candidate, run, target)
        exact.exact, exact.at = True, est.at
        if exact.fits:
            return exact
        est.fits, est.why_not = False, f"extrapolated fit, but the full trace {exact.why_not}"
    return None
