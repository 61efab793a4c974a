"""Hardware facts in one place: each known GPU's memory, dense peak FLOP/s and interconnect
bandwidth (used by telemetry's MFU and by `shardtune plan`), and the fixed memory overheads of
a CUDA process that a CPU trace cannot see.

No torch import here: the planner and the CLI read these tables without loading torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardtune.errors import UserError

GIB = 1024 ** 3


@dataclass(frozen=True)
class GPU:
    name: str  # what `shardtune plan --gpu NAME` accepts (case-insensitive)
    match: str  # the card in torch.cuda.get_device_name(): a regular expression (`gpu_by_device_name`)
    memory_mib: int  # total memory as nvidia-smi reports it
    tflops: tuple[float, float, float, float]  # dense peak TFLOP/s: (bf16, fp16, fp32, fp8); 0 = no such unit
    link_gbs: float  # effective per-GPU collective bandwidth inside a node, GB/s (NVLink, else PCIe)
    pcie_gbs: float  # effective host <-> GPU copy bandwidth per direction, GB/s (pinned memory)
    hbm_gbs: float  # memory bandwidth, GB/s (datasheet): what a memory-bound optimizer step streams
    host_gib: int  # host RAM per GPU, GiB, of the machines that carry the card: `plan`'s default --host-mem / GPU
    host_source: str  # where `host_gib` comes from: an instance type, its GPUs and its memory

    @property
    def host_bytes(self) -> int:
        return self.host_gib * GIB

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2 ** 20

    def peak_flops(self, precision: str) -> float:
        return self.tflops[{"bf16": 0, "fp16": 1, "fp32": 2, "fp8": 3}[precision]] * 1e12

    def supports(self, precision: str) -> bool:
        return self.peak_flops(precision) > 0


# Peaks: the vendors' datasheets, dense (no sparsity), fp32 without TF32; fp8 (E4M3 tensor cores,
# compute capability 8.9+) only on Ada and Hopper, 0 elsewhere. Link bandwidth: the
# bus bandwidth nccl-tests reaches for large all-reduce (about 75 % of the NVLink/PCIe figure
# per direction: NVLink3 300 GB/s -> 230, NVLink4 450 -> 360, PCIe 4 x16 32 -> 24, PCIe 3 x16
# 16 -> 12). `plan --bandwidth` overrides it. Host copies (`pcie_gbs`): about 80 % of the slot's
# per-direction figure that CUDA's bandwidthTest reaches with pinned memory (PCIe 5 x16 64 GB/s
# -> 50, PCIe 4 x16 32 -> 25, PCIe 3 x16 16 -> 12); SXM boards use the host's PCIe link too.
# `hbm_gbs`: the datasheets' memory bandwidth. Order matters for `match`: the first card found
# in a device name wins ("A100-SXM4-80GB" before "A100").
# Host RAM (`host_gib`, per GPU): the memory of a multi-GPU instance type that carries the card,
# over its GPUs, as the provider lists it (where several sizes exist, the one with the least per
# GPU: a bound that holds on the others). `plan` bounds every answer by it per node (CPU offload's
# shards, offloaded activations, the load and save) unless --host-mem says otherwise.
GPUS = [
    GPU("H200", "H200", 143771, (989.4, 989.4, 66.9, 1978.9), 360.0, 50.0, 4800.0,
        256, "AWS p5e.48xlarge: 8 x H200, 2,048 GiB"),
    GPU("H100", "H100", 81559, (989.4, 989.4, 66.9, 1978.9), 360.0, 50.0, 3350.0,
        256, "AWS p5.48xlarge: 8 x H100, 2,048 GiB"),
    GPU("H800", "H800", 81559, (989.4, 989.4, 66.9, 1978.9), 160.0, 50.0, 3350.0,
        256, "NVIDIA DGX H800: 8 x H800, 2 TiB"),
    GPU("A100-80GB", "A100-SXM4-80GB", 81920, (312.0, 312.0, 19.5, 0.0), 230.0, 25.0, 2039.0,
        144, "AWS p4de.24xlarge: 8 x A100 80GB, 1,152 GiB"),
    GPU("A100-80GB-PCIe", "A100 80GB PCIe", 81920, (312.0, 312.0, 19.5, 0.0), 24.0, 25.0, 1935.0,
        220, "Azure NC96ads_A100_v4: 4 x A100 80GB PCIe, 880 GiB"),
    GPU("A100-40GB", "A100(-PCIE)?", 40960, (312.0, 312.0, 19.5, 0.0), 230.0, 25.0, 1555.0,
        144, "AWS p4d.24xlarge: 8 x A100 40GB, 1,152 GiB"),
    GPU("L40S", "L40S", 46068, (362.1, 362.1, 91.6, 733.0), 24.0, 25.0, 864.0,
        96, "AWS g6e.12xlarge: 4 x L40S, 384 GiB"),
    GPU("A10G", "A10G", 23028, (70.0, 70.0, 31.2, 0.0), 24.0, 25.0, 600.0,
        48, "AWS g5.12xlarge: 4 x A10G, 192 GiB"),
    GPU("A10", "A10", 23028, (125.0, 125.0, 31.2, 0.0), 24.0, 25.0, 600.0,
        223, "OCI VM.GPU.A10.2: 2 x A10, 480 GB (447 GiB)"),
    GPU("L4", "L4", 23034, (121.0, 121.0, 30.3, 242.0), 24.0, 25.0, 300.0,
        48, "AWS g6.12xlarge: 4 x L4, 192 GiB"),
    GPU("RTX-4090", "RTX 4090", 24564, (165.2, 165.2, 82.6, 330.3), 24.0, 25.0, 1008.0,
        64, "no hyperscaler instance type carries it; a workstation: 4 x RTX 4090, 256 GiB"),
    GPU("RTX-3090", "RTX 3090", 24576, (71.0, 71.0, 35.6, 0.0), 24.0, 25.0, 936.0,
        64, "no hyperscaler instance type carries it; a workstation: 4 x RTX 3090, 256 GiB"),
    GPU("A6000", "A6000", 49140, (154.8, 154.8, 38.7, 0.0), 24.0, 25.0, 768.0,
        46, "Lambda gpu_4x_a6000: 4 x RTX A6000, 184 GiB"),
    GPU("V100-32GB", "V100-SXM2-32GB", 32768, (0.0, 125.0, 15.7, 0.0), 130.0, 12.0, 900.0,
        96, "AWS p3dn.24xlarge: 8 x V100 32GB, 768 GiB"),
    GPU("V100-16GB", "V100", 16384, (0.0, 125.0, 15.7, 0.0), 12.0, 12.0, 900.0,
        61, "AWS p3.8xlarge: 4 x V100 16GB, 244 GiB"),
    GPU("T4", "T4", 15360, (0.0, 65.0, 8.1, 0.0), 12.0, 12.0, 320.0,
        48, "AWS g4dn.12xlarge: 4 x T4, 192 GiB"),
]


def float8_needs(recipe: str) -> str:
    """The start of every float8 refusal: what it needs, with the table's cards that have it."""
    cards = ", ".join(g.name for g in GPUS if g.supports("fp8"))
    return f"float8={recipe} needs an NVIDIA GPU with float8 units (compute capability 8.9+: {cards})"


# every refusal of kernels=liger off a GPU (config validation for device=cpu, model.kernels for the machine)
LIGER_NEEDS_CUDA = ("kernels=liger needs a CUDA GPU: Liger-Kernel's kernels are Triton kernels with no CPU path; "
                    "set kernels=none")


def gpu_by_name(name: str) -> GPU:
    """The table entry for a name given on the command line (case-insensitive)."""
    wanted = name.strip().lower().replace(" ", "-")
    for gpu in GPUS:
        if gpu.name.lower() == wanted:
            return gpu
    count = re.fullmatch(r"(\d+)\s*[x*]\s*(.+)", name.strip(), re.IGNORECASE)  # 8xA100-80GB, as clouds write it
    if count and any(g.name.lower() == count.group(2).strip().lower().replace(" ", "-") for g in GPUS):
        raise UserError(f"--gpu names one card; give the count apart: --gpus {count.group(1)} --gpu "
                        f"{count.group(2).strip()} (--gpus is per node)")
    raise UserError(f"unknown GPU {name!r}; known: {', '.join(g.name for g in GPUS)} "
                    "(or give --gpu-mem SIZE and --peak-tflops)")


# What may follow a card's name in a device name and leave it that card: memory sizes and kinds, the SXM
# board ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB"). Anything else is another card, with other
# peaks: "NVIDIA L40" is no L4, "NVIDIA H100 PCIe" (756 bf16 TFLOP/s) and "NVL" no SXM H100 (989),
# "RTX 3090 Ti" no 3090, "T400" no T4, a MIG slice no whole card; those get no entry (MFU needs
# log.peak_tflops there).
SAME_CARD = r"(?:[ -](?:\d+GB|HBM\d*e?|SXM\d*))*"


def gpu_by_device_name(device_name: str) -> GPU | None:
    """The table entry for torch.cuda.get_device_name(): the first whose `match` ends the name
    (but for the words of SAME_CARD), or None."""
    for gpu in GPUS:
        if re.search(rf"{gpu.match}{SAME_CARD}$", device_name.strip(), re.IGNORECASE):
            return gpu
    return None


_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str, what: str, default_unit: str = "gib") -> int:
    """'16GiB', '16 GB', '15360MiB' or a bare number (in `default_unit`) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    size = float(m.group(1)) * _UNITS[unit or default_unit] if m and unit in _UNITS else 0.0
    if not 1 <= size < 2 ** 63:  # under one byte is 0 bytes once whole (0.0000000001 GiB)
        raise UserError(f"{what} {str(text)[:40]!r} is not a memory size; write it like 16GiB, 80GB or 15360MiB")
    return int(size)


# ---------------------------------------------------------------------------- fixed overheads
# What a CUDA rank holds beyond the live tensors a trace sees: the public defaults named in
# `source`, and the caching allocator's reserve over allocated, measured per technique
# (MEASURED_RESERVE). `bench/plan_accuracy.py --gpu` measures torch.cuda.max_memory_allocated /
# reserved against the prediction and is where to set them.
@dataclass(frozen=True)
class Overhead:
    value: float
    unit: str
    source: str


# The caching allocator's reserve beyond allocated, per technique, keyed by (activation
# checkpointing, peft method, what is offloaded: "none", "activations" (activation_offload) or
# "states" (fsdp.cpu_offload: parameters, gradients and optimizer state on the host)), as a share of
# the step's transient bytes at its peak: predicted allocated less the sharded parameters, gradients
# and optimizer state, which are allocated once and kept. What the allocator caches follows what a
# step frees and allocates again, not the model's states: a 1B model holds 14.2 GiB of states and
# reserves 0.5 GiB over allocated, GPT-2 small 1.9 GiB and 0.5 GiB (a share of all allocated
# over-predicted the 1B rows by 15-24 %). The two offloads cache differently: activations brought
# back for backward a block at a time beside the cached forward ones (1.9 of the transient bytes),
# states copied in and out per block (0.36; activation offloading's 1.9 over-predicted it by 117 %).
# Measured on one H200, bf16, seq 1024, torch 2.11 (PLAN_ACCURACY_GPU, `bench/plan_accuracy.py
# --gpu`; re-predicted after the planner changes with `--recorded`). The rule: for each row
# (measured max_memory_reserved - predicted allocated) / predicted transient; a technique takes its
# rows' largest, rounded up to the next 0.01 and never below 0, so no measured row is
# under-predicted. tests/plan/test_reserve_calibration.py holds the rows.
PLAN_ACCURACY_GPU = ("bench/gpu/results/2026-11-26-h200-b/call1/plan_accuracy.md, -h200-c/call2/plan_accuracy.md "
                     "and 2026-11-27-h200/call1/plan_accuracy.md (one H200, bf16, seq 1024, torch 2.11)")
OFFLOADS = ("none", "activations", "states")
MEASURED_RESERVE = {
    ("none", "none", "none"): Overhead(0.09, "share of transient", "gpt2-small, micro-batch 8: (7,342 MiB reserved "
                                       "- 6,899 predicted allocated) / 4,988 transient = 0.089"),
    ("full", "none", "none"): Overhead(0.50, "share of transient", "llama-1b, micro-batch 4, fsdp.reduce_dtype=bf16: "
                                       "(16,554 - 15,887) / 1,342 = 0.497 (fp32 reduction 0.403; gpt2-small, "
                                       "micro-batch 16: 0.336): the recomputed blocks' buffers are cached apart"),
    ("selective", "none", "none"): Overhead(0.22, "share of transient", "llama-1b, micro-batch 4: (19,776 - "
                                            "18,839) / 4,294 = 0.218"),
    ("every_n", "none", "none"): Overhead(0.14, "share of transient", "llama-1b, every 2nd block, micro-batch 4: "
                                          "(19,288 - 18,707) / 4,162 = 0.140"),
    ("none", "lora", "none"): Overhead(0.03, "share of transient", "llama-100m, LoRA, micro-batch 8: (3,770 - 3,702) "
                                       "/ 3,186 = 0.021"),
    ("none", "none", "activations"): Overhead(1.93, "share of transient", "llama-1b, activation offloading, "
                                              "micro-batch 2: (18,652 - 15,947) / 1,402 = 1.929"),
    ("full", "none", "states"): Overhead(0.36, "share of transient", "llama-1b, fsdp.cpu_offload=true, full "
                                         "checkpointing, micro-batch 4: (1,814 - 1,342) / 1,342 = 0.352"),
}
# What a step extra (`step_extra`) adds to that reserve: float8's casts and torchao's optimizer step
# (train.optimizer_state 8bit, 4bit and bf16: one compiled step per parameter shape) allocate buffers
# of their own away from the traced peak, which the allocator keeps cached. One row each (llama-1b,
# full checkpointing, micro-batch 4), so the form is chosen, not fitted: a share of the predicted
# allocated, which grows with the model and the step alike (as a share of the transient bytes, as
# above, a step without checkpointing would be priced at 3x its allocated). The rule: (measured
# reserved - predicted reserved without the extra) / predicted allocated, rounded up to the next
# 0.01; an extra never measured takes the largest measured, extras together the sum.
EXTRA_RESERVE = {
    "float8": Overhead(0.15, "share of allocated", "rowwise (18,846 - 16,558) / 15,887 = 0.144, tensorwise (18,846 "
                       "- 16,484) / 15,838 = 0.149"),
    "8bit state": Overhead(0.25, "share of allocated", "(13,684 - 11,133) / 10,462 = 0.244"),
    "4bit state": Overhead(0.39, "share of allocated", "(13,920 - 10,252) / 9,581 = 0.383: torchao's 4-bit step also "
                           "allocates 230 MiB beyond the traced tensors"),
    "bf16 state": Overhead(0.21, "share of allocated", "(15,454 - 12,922) / 12,251 = 0.207"),
}
STATES = ("sharded_params", "gradients", "optimizer_state")  # allocated once and kept: no reserve beside them

CUDA_OVERHEADS = {
    # Inside torch's allocator (counted by max_memory_allocated and reserved):
    "cublas_workspace": Overhead(
        64 * 2 ** 20, "bytes",
        "PyTorch's default CUBLAS_WORKSPACE_CONFIG ':4096:8' on sm90 (8 x 4 MiB), one per cuBLAS handle and stream: "
        "the forward's thread and autograd's backward thread each hold one (measured beyond the traced tensors: "
        "65-72 MiB on six llama-1b rows, H200, torch 2.11)"),
    "allocation_rounding": Overhead(
        512, "bytes", "CUDACachingAllocator rounds every block up to 512 B (kMinBlockSize)"),
    # Outside torch's allocator (in nvidia-smi's figure, not in max_memory_reserved):
    "cuda_context": Overhead(
        500 * 2 ** 20, "bytes", "CUDA context + torch kernels loaded lazily: 300-600 MiB per process (CUDA "
        "lazy loading, CUDA_MODULE_LOADING=LAZY default since CUDA 11.7)"),
    "nccl_buffers": Overhead(
        4 * 2 ** 20, "bytes per channel and peer",
        "NCCL_BUFFSIZE default 4 MiB; the ring/tree uses about 2 channels per peer on PCIe, more on NVLink"),
    "nccl_channels": Overhead(16, "channels", "NCCL's typical channel count on NVLink systems (NCCL_MAX_NCHANNELS)"),
}


def step_extra(float8: str = "none", optimizer_state: str = "fp32") -> str:
    """The part of a technique that allocates buffers away from the traced peak (EXTRA_RESERVE):
    "float8", torchao's optimizer step ("8bit state", "4bit state", "bf16 state"), both joined by
    "+", or ""."""
    torchao_step = [f"{optimizer_state} state"] if optimizer_state != "fp32" else []
    return "+".join((["float8"] if float8 != "none" else []) + torchao_step)


def technique(checkpointing: str, peft_method: str, activation_offload: bool, cpu_offload: bool,
              float8: str = "none", optimizer_state: str = "fp32") -> tuple:
    """What the allocator's reserve depends on: MEASURED_RESERVE's key and the step extra. With both
    offloads, the activations' (the larger reserve)."""
    offload = "activations" if activation_offload else "states" if cpu_offload else "none"
    return checkpointing, peft_method, offload, step_extra(float8, optimizer_state)


def reserve_share(checkpointing: str = "", peft_method: str = "", offload: str = "none") -> float:
    """The allocator's reserve over allocated, as a share of the step's transient bytes, for a
    technique: measured where MEASURED_RESERVE has its row, else the widest measured for a technique
    that offloads what this one does (an unmeasured one is not under-predicted by a smaller share
    than one measured)."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload {offload!r} is not one of {OFFLOADS}")
    measured = MEASURED_RESERVE.get((checkpointing, peft_method, offload))
    if measured:
        return measured.value
    return max(o.value for key, o in MEASURED_RESERVE.items() if key[2] == offload)


def extra_reserve(extra: str = "") -> float:
    """What a step extra adds to the reserve, as a share of allocated: each part's measured share
    (one never measured: the largest measured), summed."""
    widest = max(o.value for o in EXTRA_RESERVE.values())
    return sum(EXTRA_RESERVE[part].value if part in EXTRA_RESERVE else widest for part in extra.split("+") if part)


def calibrated() -> str:
    """The techniques whose reserve was measured, in words (plan's answer names them)."""
    names = {"none": "no checkpointing", "full": "full checkpointing", "selective": "selective checkpointing",
             "every_n": "every-n checkpointing", "lora": "LoRA", "activations": "activation offloading",
             "states": "CPU offload"}
    seen = []
    for key in MEASURED_RESERVE:
        for part in (key[0], key[1] if key[1] != "none" else "", key[2] if key[2] != "none" else ""):
            if part and names.get(part, part) not in seen:
                seen.append(names.get(part, part))
    return ", ".join(seen + [e.replace(" state", " optimizer state") for e in EXTRA_RESERVE])


def overhead(name: str) -> float:
    return CUDA_OVERHEADS[name].value


# Host-side assumptions for ranking offload (CPU AdamW and the host<->GPU copies).
HOST_FACTS = {
    "pcie_gbs": Overhead(24.0, "GB/s", "PCIe 4.0 x16, about 75 % of 32 GB/s per direction"),
    "host_adam_gbs": Overhead(20.0, "GB/s", "memory bandwidth one rank's CPU AdamW streams (fused CPU kernel)"),
    "inter_node_gbs": Overhead(12.5, "GB/s", "one 100 Gb/s InfiniBand/RoCE NIC per GPU; plan --inter-node-bandwidth"),
    # model FLOPs utilisation of a step (useful FLOPs over the 16-bit dense peak), fitted to the measured
    # one-GPU rows (tests/plan/test_speed_model.py holds them and checks each within 15 %)
    "mfu": Overhead(0.35, "share of peak", "eager, measured with bench/vs_hf_trainer.py --gpu (bf16, seq 2048, "
                    "full_shard): Llama ~1B 30.1 % on an H100 and 33.3 % on an H200, OPT-1.3B 38.0 % on an H100"),
    "mfu_compiled": Overhead(0.47, "share of peak", "compile=true: the eager figure x 1.34, the gain measured on an "
                             "H200 (Llama ~1B, bench/liger_speed.py: 51,034 -> 68,172 tokens/s in one call; "
                             "bench/vs_hf_trainer.py --gpu compile=true: 71,486 tokens/s, MFU 44.3 %), 2026-11-26"),
}
