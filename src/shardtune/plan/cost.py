"""What a candidate costs on the asked-for machine, from a traced step: each GPU's memory (what a
trace sees, plus what a CUDA process adds), each node's host memory, and the seconds per
optimizer step (compute with its recomputation, communication, host copies, the optimizer)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from shardtune.config.compiling import compiles
from shardtune.config.schema import RunConfig
from shardtune.families import hidden_size
from shardtune.hardware import GPU, HOST_FACTS, STATES, extra_reserve, overhead, reserve_share, technique
from shardtune.plan.trace import HOST_ONLY, OFFLOADED, StepTrace

STATE_PRECISIONS = ("fp32", "bf16", "8bit", "4bit")
CHECKPOINTING = ("none", "selective", "every_n", "full")
# Selective checkpointing keeps every matmul (and attention) output and recomputes the cheap
# ops between them in backward: norms, activations, rotary, residual adds. They are memory-bound;
# their time is the bytes they stream, about this many passes over the block's hidden states.
SELECTIVE_PASSES = 12
# Share of memory bandwidth an optimizer step reaches: torch's fused AdamW streams its tensors
# once; torchao's low-bit step (torch.compile'd per parameter) adds the block-wise (de)quantization.
OPTIMIZER_EFFICIENCY = {"fp32": 0.8, "bf16": 0.8, "8bit": 0.5, "4bit": 0.4}
# float8's casts, memory-bound: bytes each cast streams per bf16 value (read for the scale, read
# again and written as float8: 2 + 2 + 1), and eager, where the absolute values and the scaled
# copy are kernels of their own, about twice that. Per token a converted layer casts its input and
# its output gradient: rowwise along both axes (forward and backward use different ones),
# tensorwise once each (one scale serves both).
FLOAT8_CAST_BYTES = {"compiled": 5, "eager": 9}
FLOAT8_CASTS = {"rowwise": 2, "tensorwise": 1}
# Share of the float8 peak the converted matmuls reach, relative to the MFU the 16-bit ones reach:
# NOT YET MEASURED HERE. Set so that this model gives torchao's published end-to-end gains for
# Llama-3-8B on 8 x H100 (seq 8192, compiled, FSDP): +10 % rowwise (its row scales cost the GEMM
# more), +25 % tensorwise with float8 all-gather. bench/gpu/run.sh's float8 stage measures them.
FLOAT8_EFFICIENCY = {"rowwise": 0.63, "tensorwise": 0.74}
NOMINAL_TFLOPS = (100.0, 100.0, 15.0, 200.0)  # bf16, fp16, fp32, fp8 of a card given by --gpu-mem alone


@dataclass(frozen=True)
class Candidate:
    sharding: str
    precision: str
    micro_batch: int
    checkpointing: str = "none"  # none, selective, every_n, full
    every: int = 2  # every_n's block interval
    activation_offload: bool = False
    reduce_dtype: str = "fp32"
    optimizer_state: str = "fp32"
    cpu_offload: bool = False

    def layout(self) -> tuple:
        """What a trace depends on (the optimizer state and CPU offload are priced from it)."""
        return (self.sharding, self.precision, self.checkpointing, self.every, self.activation_offload,
                self.reduce_dtype)

    def settings(self, target: Target | None = None) -> dict:
        """The config keys this candidate sets, as `train` takes them."""
        out = {"precision": self.precision, "activation_checkpointing": self.checkpointing,
               "activation_offload": self.activation_offload, "fsdp.sharding": self.sharding,
               "fsdp.reduce_dtype": self.reduce_dtype, "fsdp.cpu_offload": self.cpu_offload,
               "train.optimizer_state": self.optimizer_state, "train.micro_batch_size": self.micro_batch}
        if self.checkpointing == "every_n":
            out["activation_checkpointing_every"] = self.every
        if self.sharding == "hybrid_shard" and target is not None:
            out.update({"fsdp.shard_size": target.gpus_per_node, "fsdp.replicate_size": target.nodes})
        return out

    def apply(self, cfg: RunConfig, target: Target | None = None) -> RunConfig:
        out = copy.deepcopy(cfg)
        for key, value in self.settings(target).items():
            path, _, name = key.rpartition(".")
            setattr(setting(out, path) if path else out, name, value)
        return out

    def technique(self, cfg: RunConfig) -> tuple:
        """What the allocator's reserve depends on: hardware.MEASURED_RESERVE's key and the step extra."""
        return technique(self.checkpointing, cfg.peft.method, self.activation_offload, self.cpu_offload, cfg.float8,
                         self.optimizer_state)

    def label(self) -> str:
        ac = f"every {self.every}" if self.checkpointing == "every_n" else self.checkpointing
        return (f"{self.sharding}, {self.precision}, checkpointing {ac}"
                f"{', activations to host' if self.activation_offload else ''}"
                f"{', bf16 reduce' if self.reduce_dtype == 'bf16' else ''}, {self.optimizer_state} optimizer state, "
                f"offload {'on' if self.cpu_offload else 'off'}, micro-batch {self.micro_batch}")


def setting(cfg: RunConfig, dotted: str):
    """The value (or section) of a dotted config key, e.g. "fsdp.sharding"."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


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
    host_bytes: int | None = None  # host RAM per node (None: unbounded)
    margin: float = 0.05  # share of GPU memory kept free
    host_source: str = ""  # where host_bytes comes from (--host-mem, or the GPU's default and its source)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak_flops(self, precision: str) -> float:
        """The card's dense peak for `precision` (a nominal card's without --gpu, so ranks still hold).
        --peak-tflops names the 16-bit peak: the other precisions keep their ratio to it (fp32 at the
        16-bit rate priced an fp32 layout 6-16x fast, tying it with bf16). A precision without units
        of its own (bf16 on a T4 or V100) runs emulated, at the fp32 rate: never a zero peak."""
        table = dict(zip(("bf16", "fp16", "fp32", "fp8"), self.gpu.tflops if self.gpu is not None
                         else NOMINAL_TFLOPS, strict=True))
        scale = self.peak_tflops / max(table["bf16"], table["fp16"]) if self.peak_tflops else 1.0
        return (table[precision] or table["fp32"]) * scale * 1e12

    def link_gbs(self) -> float:
        intra = self.bandwidth_gbs or (self.gpu.link_gbs if self.gpu else 24.0)
        return intra if self.nodes == 1 else min(intra, self.inter_node_gbs)

    def pcie_gbs(self) -> float:
        return self.gpu.pcie_gbs if self.gpu else HOST_FACTS["pcie_gbs"].value

    def hbm_gbs(self) -> float:
        return self.gpu.hbm_gbs if self.gpu else 1000.0  # a nominal card: the optimizer is a small term


def gpu_memory(trace: StepTrace, offload: bool, world_size: int, technique: tuple = ()) -> dict:
    """One CUDA rank's memory from a trace: the peak of what stays on the GPU, by category, then
    allocated (+ cuBLAS workspace), reserved (+ the allocator's reserve for `technique`, a share of
    the transient bytes as hardware.reserve_share takes it, none given: the widest measured of the
    techniques that do not offload; + a share of allocated for its step extra, hardware.extra_reserve)
    and the fixed overhead
    outside torch's allocator (CUDA context, NCCL buffers), and their sum, what nvidia-smi shows."""
    leave_out = (OFFLOADED if offload else ()) + HOST_ONLY
    phase, cats = trace.peak(leave_out)
    on_gpu = {k: v for k, v in cats.items() if k not in leave_out}
    allocated = sum(on_gpu.values()) + int(overhead("cublas_workspace"))
    transient = allocated - sum(on_gpu.get(k, 0) for k in STATES)
    reserved = allocated + int(transient * reserve_share(*technique[:3]))
    reserved += int(allocated * extra_reserve(*technique[3:]))
    nccl = int(overhead("nccl_buffers") * overhead("nccl_channels") * 2) if world_size > 1 else 0
    fixed = int(overhead("cuda_context")) + nccl
    return {"phase": phase, "by_category": on_gpu, "allocated": allocated, "transient": transient, "reserved": reserved,
            "fixed_overhead": fixed, "total": reserved + fixed}


def host_memory(trace: StepTrace, offload: bool, ranks_per_node: int, world: int = 1,
                sharded_load: bool = False, sharded_save: bool = False, cfg: RunConfig | None = None) -> dict:
    """Host RAM of one node. Load: rank 0 reads the full fp32 weights once (then hands out
    shards; random weights are made there too), or with model.sharded_load every rank reads only
    its 1/world of them. Save (final/): gathered whole on rank 0, or with checkpoint.sharded_final
    each rank writes its own rows in place (a bound: the rows pass through the host a chunk at a
    time); nothing with save_final=false. CPU offload keeps every rank's shards (and the optimizer
    step's transient beside them), activation offloading every rank's saved activations at their
    peak, checkpoint.async_save a staged copy of every rank's shards and optimizer state (DCP
    copies them to the host, then writes)."""
    full_fp32 = 4 * trace.params["total"]
    per_node = ranks_per_node * -(-full_fp32 // max(world, 1))
    load, save = (per_node if sharded_load else full_fp32), (per_node if sharded_save else full_fp32)
    if cfg is not None and not cfg.save_final:
        save = 0
    offloaded = 0
    if offload:  # the states, and the optimizer step's transient: the step runs on the host beside them
        step = max((cats.get("optimizer_step", 0) for cats in trace.phases.values()), default=0)
        offloaded = ranks_per_node * (sum(trace.steady.get(c, 0) for c in OFFLOADED) + step)
    activations = ranks_per_node * offloaded_activation_bytes(trace)
    staged = ranks_per_node * sum(trace.steady.get(c, 0) for c in ("sharded_params", "optimizer_state")) \
        if cfg is not None and cfg.checkpoint.async_save else 0
    return {"load": load, "load_path": "sharded" if sharded_load else "rank 0",
            "save": save, "save_path": "sharded" if sharded_save else "rank 0",
            "cpu_offload": offloaded, "activation_offload": activations, "async_save": staged,
            "total": max(load, save) + offloaded + activations + staged}


def offloaded_activation_bytes(trace: StepTrace) -> int:
    """The most saved activations one rank holds in host memory at once (those of a micro-step)."""
    return trace.params.get("offloaded_activations", 0)


def step_time(trace: StepTrace, hf_config, cand: Candidate, cfg: RunConfig, target: Target, accum: int) -> dict:
    """Seconds per optimizer step, by part: compute at an assumed MFU with its recomputation,
    communication overlapped with it (FSDP prefetches), activation copies on a side stream
    (overlapped too, but sharing a PCIe link with the collectives where that is the link), the
    optimizer step (memory-bound), and CPU offload's copies and host AdamW (not overlapped)."""
    from shardtune.telemetry.flops import attention_flops, flops_per_token

    p, seq, world = trace.params, cfg.data.seq_len, target.world
    tokens = cand.micro_batch * accum * seq  # per rank per step
    fpt = flops_per_token(p["matmul"], hf_config, seq, p["matmul_trainable"])
    forward = 2.0 * p["matmul"] + attention_flops(hf_config, seq)  # blocks' matmuls and attention (counted)
    peak, mfu = target.peak_flops(cand.precision), assumed_mfu(cfg, cand)
    compute = tokens * (fpt + forward * recomputed_forwards(cand)) / (peak * mfu)
    if cfg.float8 != "none":
        compute += float8_seconds(p, cfg, cand, target, tokens)
    if cfg.peft.method == "prompt_tuning":  # its virtual tokens pass through every layer, unpredicted
        compute *= (seq + cfg.peft.virtual_tokens) / seq
    if cfg.peft.quantize == "4bit":  # bitsandbytes dequantizes every 4-bit weight per use
        from shardtune.plan.qlora import dequant_seconds

        compute += dequant_seconds(p, recomputed_forwards(cand), accum, target.hbm_gbs())
    if cand.checkpointing == "selective":  # the cheap ops again: memory-bound passes over the hidden states
        act_bytes = 4 if cand.precision == "fp32" else 2
        compute += SELECTIVE_PASSES * tokens * trace.layers * _hidden(hf_config) * act_bytes / (target.hbm_gbs() * 1e9)
    dtype_bytes = 4 if cand.precision == "fp32" else 2
    gathered = p["total"] * dtype_bytes
    if cfg.float8 == "tensorwise":  # its converted weights are gathered as float8: one byte each
        gathered -= p.get("float8_matmul", 0) * (dtype_bytes - 1)
    grads = p["trainable"] * (2 if cand.reduce_dtype == "bf16" else 4)
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
    copies = accum * 2 * offloaded_activation_bytes(trace) / (target.pcie_gbs() * 1e9) if cand.activation_offload \
        else 0.0
    if target.link_gbs() <= target.pcie_gbs():  # collectives over PCIe: the activation copies share the bus
        overlapped = max(compute, comm + copies)
    else:
        overlapped = max(compute, comm, copies)
    shard = p["trainable"] / shard_group
    offload = optimizer = 0.0
    if cand.cpu_offload:
        pcie = min(HOST_FACTS["pcie_gbs"].value, target.gpu.link_gbs if target.gpu else 1e9)  # PCIe 3 cards
        offload = accum * 2 * p["total"] * 4 / shard_group / (pcie * 1e9)  # parameters in, gradients out
        optimizer = 28 * shard / (HOST_FACTS["host_adam_gbs"].value * 1e9)
    else:  # read parameter, gradient, both moments; write parameter and moments
        moment = {"fp32": 4, "bf16": 2, "8bit": 1 + 4 / 256, "4bit": 0.5 + 4 / 128}[cand.optimizer_state]
        optimizer = shard * (3 * 4 + 4 * moment) / (target.hbm_gbs() * 1e9
                                                     * OPTIMIZER_EFFICIENCY[cand.optimizer_state])
    total = overlapped + offload + optimizer
    return {"compute": compute, "communication": comm, "activation_copies": copies, "cpu_offload": offload,
            "optimizer": optimizer, "total": total}


def compiled(cfg: RunConfig, cand: Candidate) -> bool:
    """Whether train compiles `cand`'s blocks (config.compiling: compile=auto is on for the GPU a plan
    is for; off for a run set to device=cpu)."""
    return compiles(cfg.compile, "cpu" if cfg.device == "cpu" else "cuda", cand.activation_offload, cfg.peft.quantize)


def assumed_mfu(cfg: RunConfig, cand: Candidate) -> float:
    """The share of the 16-bit peak the step's matmuls reach, eager or compiled: both measured."""
    return HOST_FACTS["mfu_compiled" if compiled(cfg, cand) else "mfu"].value


def recomputed_forwards(cand: Candidate) -> float:
    """The blocks' forward passes backward runs again: full 1, every n-th block 1/n, none 0, and
    selective 0 (its cheap recomputed ops are priced apart, by the bytes they stream)."""
    return {"full": 1.0, "every_n": 1.0 / max(cand.every, 1)}.get(cand.checkpointing, 0.0)


def float8_seconds(p: dict, cfg: RunConfig, cand: Candidate, target: Target, tokens: int) -> float:
    """What float8 changes in the compute time (negative: it saves): the converted layers' matmuls
    at the float8 peak instead of the 16-bit one (forward, backward's two, and a recomputed
    forward), plus their casts (FLOAT8_CAST_BYTES)."""
    flops = tokens * (6 + 2 * recomputed_forwards(cand)) * p.get("float8_matmul", 0)
    mfu = assumed_mfu(cfg, cand)
    faster = flops / (target.peak_flops("fp8") * mfu * FLOAT8_EFFICIENCY[cfg.float8]) \
        - flops / (target.peak_flops(cand.precision) * mfu)
    cast = FLOAT8_CAST_BYTES["compiled" if compiled(cfg, cand) else "eager"] * FLOAT8_CASTS[cfg.float8]
    return faster + tokens * p.get("float8_widths", 0) * cast / (target.hbm_gbs() * 1e9)


def _hidden(hf_config) -> int:
    return hidden_size(hf_config) or 0
