"""How right is `shardtune plan`? The predicted per-rank peak against the peak of the same
training step really run.

CPU (default): the traced peak (plan.trace.trace_step, fake tensors, fake process group) against
the peak bytes rank 0 holds in a real run of N ranks (plan.measure: the allocator's count over the
second of two steps, gloo's own copies included; not RSS). Goal: no row under by more than 1 %,
none over by more than 3 %. Rows: a GPT-2-small shape and a ~100M Llama shape, 1/2/4 ranks,
full_shard and no_shard, activation checkpointing none/full/selective/every-n, LoRA, micro-batch
1/4/8, optimizer state fp32/bf16/8-bit (for bf16/8-bit: the state's bytes, torchao's compiled step
cannot run under the tracker), bf16 reduction, activation offloading (`--new`: only those).

`--gpu`: the prediction for a CUDA rank (plan.gpu_memory: trace with CUDA's kernel choices +
hardware.CUDA_OVERHEADS) against torch.cuda.max_memory_allocated and max_memory_reserved of the
real step, on 1 GPU and on all visible GPUs, six configs including a ~1B Llama shape. Without a
CUDA GPU it stops with a one-line error. Its rows are where the overhead constants get set.
`--gpu --rehearse` runs the GPU rows' code path on CPU with tiny models of the same architectures
(the CUDA prediction against the CPU's live-tensor peak, which stands in for allocated/reserved).

    .venv/bin/python bench/plan_accuracy.py [--gpu [--rehearse]] [--rows N | --pick I,J] [--seq-len 128]

`--recorded FILE` (no GPU needed): the rows of an earlier `--gpu` run's table, predicted again by
today's planner (on this CPU, for the CUDA target) against the measurements recorded there, and
the calibration they imply: how a change to the planner moves it against real GPU rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import args_only, tiny_model  # noqa: E402

SHAPES = {
    "gpt2-small": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                   "n_positions": 2048},
    "llama-100m": {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 2048,
                   "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
                   "max_position_embeddings": 4096},
    "llama-1b": {"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 5632,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                 "max_position_embeddings": 4096},
}
# (shape, ranks, sharding, activation checkpointing, LoRA, micro-batch[, other settings])
CPU_ROWS = [
    ("gpt2-small", 1, "full_shard", "none", False, 4),
    ("gpt2-small", 2, "full_shard", "none", False, 4),
    ("gpt2-small", 4, "full_shard", "none", False, 4),
    ("gpt2-small", 2, "no_shard", "none", False, 4),
    ("gpt2-small", 2, "full_shard", "full", False, 8),
    ("gpt2-small", 2, "full_shard", "none", True, 8),
    ("gpt2-small", 4, "no_shard", "full", False, 1),
    ("llama-100m", 1, "full_shard", "full", False, 8),
    ("llama-100m", 2, "full_shard", "none", False, 1),
    ("llama-100m", 4, "full_shard", "full", False, 4),
    ("llama-100m", 2, "no_shard", "none", True, 4),
    ("llama-100m", 4, "full_shard", "none", True, 8),
    # issue 20's memory savers (on CPU activation offloading moves nothing: the same peak as none;
    # the low-bit optimizer rows on llama-100m: measured while torchao's compiled step failed on
    # GPT-2's uneven vocabulary shards, 25129 and 25128 rows on 2 ranks; fixed in train/optim.py)
    ("gpt2-small", 2, "full_shard", "selective", False, 4),
    ("gpt2-small", 2, "full_shard", "every_n", False, 4),
    ("llama-100m", 2, "full_shard", "selective", False, 4),
    ("llama-100m", 2, "full_shard", "none", False, 4, ("train.optimizer_state=bf16",)),
    ("llama-100m", 2, "full_shard", "none", False, 4, ("train.optimizer_state=8bit",)),
    ("gpt2-small", 2, "full_shard", "none", False, 4, ("precision=bf16", "fsdp.reduce_dtype=bf16")),
    ("gpt2-small", 2, "full_shard", "none", False, 4, ("activation_offload=true",)),
]
NEW_ROWS = CPU_ROWS[-7:]
GPU_ROWS = [
    ("gpt2-small", 1, "full_shard", "none", False, 8),
    ("gpt2-small", 0, "full_shard", "full", False, 16),
    ("llama-100m", 1, "full_shard", "none", True, 8),
    ("llama-1b", 1, "full_shard", "full", False, 4),
    ("llama-1b", 0, "full_shard", "full", False, 4),
    ("llama-1b", 0, "no_shard", "none", False, 2),
    # the memory savers and float8 (float8 rows: only on compute capability 8.9+)
    ("llama-1b", 1, "full_shard", "selective", False, 4),
    ("llama-1b", 1, "full_shard", "none", False, 2, ("activation_offload=true",)),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("train.optimizer_state=8bit",)),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("fsdp.reduce_dtype=bf16",)),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("float8=rowwise",)),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("float8=tensorwise",)),
    # the rest of what the planner can recommend (issue 33: every technique one real step on a GPU)
    ("llama-1b", 1, "full_shard", "every_n", False, 4),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("fsdp.cpu_offload=true",)),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("train.optimizer_state=4bit",)),
    ("llama-1b", 1, "full_shard", "full", False, 4, ("train.optimizer_state=bf16",)),
    # QLoRA (only where bitsandbytes imports: QLORA=1 bash bench/gpu/wheels.sh)
    ("llama-1b", 1, "full_shard", "none", True, 4, ("peft.quantize=4bit",)),
]  # ranks 0: every visible GPU


def run_config(shape: str, ranks: int, sharding: str, ac: str, lora: bool, mb: int, seq: int, device: str,
               precision: str, target: str, tiny: bool, extra: tuple = ()):
    from shardtune.config.load import load_config

    model = tiny_model(SHAPES[shape]) if tiny else SHAPES[shape]
    return load_config(None, [f"model.config={json.dumps(model)}", "data.path=unused",
                              f"data.seq_len={seq}", f"train.micro_batch_size={mb}",
                              f"train.global_batch_size={2 * mb * ranks}", f"fsdp.sharding={sharding}",
                              f"activation_checkpointing={ac}", f"device={device}",
                              f"precision={precision}", *(["peft.method=lora"] if lora else []), *extra])


def _state_only(cfg) -> bool:
    """torchao's compiled step cannot run under torch's MemTracker: for a low-precision optimizer
    state the row compares the state's bytes on rank 0 (the one thing priced differently)."""
    return cfg.train.optimizer_state != "fp32"


def worker(spec: dict, out: Path) -> None:
    """One rank of a real run: measure a steady step, rank 0 writes the numbers."""
    import torch
    import torch.distributed as dist

    from shardtune.distributed.process_group import init_distributed
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.measure import measure_step

    cfg = run_config(**spec)
    d = init_distributed(spec["device"])
    hf_config = load_hf_config(cfg.model)
    # on CUDA the counters below are read untracked, so a low-bit state's step runs whole (two steps)
    result = {"live_peak": measure_step(cfg, hf_config, d, state_only=_state_only(cfg) and d.device.type == "cpu")}
    if d.device.type == "cuda":  # measure_step ran two steps; the counters' peak is the steady one's
        result["allocated"] = torch.cuda.max_memory_allocated(d.device)
        result["reserved"] = torch.cuda.max_memory_reserved(d.device)
    if d.is_main:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(spec: dict, workdir: Path) -> dict:
    out = workdir / f"row-{time.time_ns()}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // spec["ranks"]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['ranks']}",
           __file__, "--worker", json.dumps(spec), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"error: the real run failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def predict(spec: dict) -> dict:
    from shardtune.hardware import technique as technique_of
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.cost import gpu_memory
    from shardtune.plan.trace import trace_step

    cfg = run_config(**spec)
    hf_config = load_hf_config(cfg.model)
    target = spec["target"]
    t0 = time.perf_counter()
    trace = trace_step(cfg, hf_config, spec["ranks"], target=target)
    out = {"trace_s": time.perf_counter() - t0, "live_peak": trace.peak_bytes()}
    if _state_only(cfg):
        out["live_peak"] = trace.steady["optimizer_state"]
    if target == "cuda":
        technique = technique_of(cfg.activation_checkpointing, cfg.peft.method, cfg.activation_offload,
                                 cfg.fsdp.cpu_offload, cfg.float8, cfg.train.optimizer_state)
        mem = gpu_memory(trace, cfg.fsdp.cpu_offload, spec["ranks"], technique)
        out.update(allocated=mem["allocated"], reserved=mem["reserved"], technique=technique,
                   transient=mem["transient"])
    return out


def calibration(rows: list[tuple[dict, dict]]) -> str:
    """What the measured rows say hardware.MEASURED_RESERVE should be (per row: measured reserved
    less predicted allocated, over the predicted transient bytes, rounded up to the next 0.01, never
    below 0; a technique takes its rows' largest), and what allocation adds beyond the traced
    tensors (the prediction's allocated less its cuBLAS workspace, against the measured allocated)."""
    import math
    import statistics

    from shardtune.hardware import extra_reserve, overhead, reserve_share

    def share(pred: dict, real: dict) -> str:
        technique = pred.get("technique", ())
        if len(technique) > 3 and technique[3]:  # an extra's share of allocated, beside its technique's share
            base = pred["allocated"] + pred["transient"] * reserve_share(*technique[:3])
            need = math.ceil(100 * (real["reserved"] - base) / pred["allocated"]) / 100
            return f"{technique[3]}: {need:.2f} of allocated (now {extra_reserve(technique[3]):.2f})"
        need = max(0.0, math.ceil(100 * (real["reserved"] - pred["allocated"]) / pred["transient"]) / 100)
        return f"{technique[:3]}: {need:.2f} (now {reserve_share(*technique[:3]):.2f})"

    shares = [share(pred, real) for pred, real in rows]
    extra = [(real["allocated"] - (pred["allocated"] - overhead("cublas_workspace"))) / 2 ** 20 for pred, real in rows]
    return (f"calibration: MEASURED_RESERVE (share of the transient bytes) and EXTRA_RESERVE per row "
            f"{'; '.join(shares)}; measured "
            f"allocated beyond the traced tensors, MiB: {', '.join(f'{e:,.0f}' for e in extra)} -> cublas_workspace = "
            f"{statistics.median(extra):,.0f} MiB (now {overhead('cublas_workspace') / 2 ** 20:,.0f})")


def table_row(spec: dict, pred: dict, real: dict, kinds: list[str]) -> tuple[str, list[float]]:
    """One table row of `spec`: predicted | measured | error for each of `kinds`; and the errors."""
    errors = [(pred[k] - real[k]) / real[k] for k in kinds]
    cells = [f"{pred[k] / 2 ** 20:,.0f} | {real[k] / 2 ** 20:,.0f} | {100 * e:+.1f} %"
             for k, e in zip(kinds, errors, strict=True)]
    lora = "yes" if spec["lora"] else "no"
    return (f"| {spec['shape']} | {spec['ranks']} | {spec['sharding']} | {spec['ac']} | {lora} | {spec['mb']} | "
            f"{' '.join(spec['extra']) or '-'} | " + " | ".join(cells) + " |"), errors


def recorded_rows(text: str) -> tuple[int, list[tuple[dict, dict]]]:
    """The sequence length and the (spec, measured) rows of a `--gpu` run's table (each distinct row once)."""
    seq = int(re.search(r"\| seq (\d+) \|", text).group(1))
    rows, seen = [], set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 14 or cells[0] not in SHAPES or tuple(cells[:7]) in seen:
            continue
        seen.add(tuple(cells[:7]))
        shape, ranks, sharding, ac, lora, mb, other = cells[:7]
        spec = dict(shape=shape, ranks=int(ranks), sharding=sharding, ac=ac, lora=lora == "yes", mb=int(mb), seq=seq,
                    # auto: the config of a CUDA row (float8 is refused for device=cpu); traced here on fake tensors
                    device="auto", precision="bf16", target="cuda", tiny=False,
                    extra=() if other == "-" else tuple(other.split()))
        mib = [int(c.replace(",", "")) * 2 ** 20 for c in (cells[8], cells[11])]
        rows.append((spec, {"allocated": mib[0], "reserved": mib[1]}))
    return seq, rows


def recorded(path: Path) -> int:
    """Today's predictions against the measurements of an earlier --gpu run (its table)."""
    import torch

    text = path.read_text()
    seq, rows = recorded_rows(text)
    print(f"{path}: {len(rows)} rows measured there (seq {seq}), predicted now (torch {torch.__version__}, this "
          "CPU, CUDA target)")
    print("| model | ranks | sharding | checkpointing | LoRA | micro-batch | other | predicted allocated MiB | "
          "measured allocated MiB | error | predicted reserved MiB | measured reserved MiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    under = over = 0.0
    pairs = []
    first_step_only = text[:16] <= "2026-11-26 12:00"  # the table's date: before a low-bit state's step ran whole
    for spec, real in rows:
        if first_step_only and any(e.startswith("train.optimizer_state=") for e in spec["extra"]):
            print(f"| {spec['shape']} | … | {' '.join(spec['extra'])} | left out: measured over the first step only |")
            continue
        pred = predict(spec)
        pairs.append((pred, real))
        line, (_, reserved_error) = table_row(spec, pred, real, ["allocated", "reserved"])
        under, over = max(under, -reserved_error), max(over, reserved_error)
        print(line, flush=True)
    met = under <= 0.02 and over <= 0.10
    print(f"reserved: most under {100 * under:.1f} %, most over {100 * over:.1f} % (goal: under by at most 2 %, "
          f"over by at most 10 %: {'met' if met else 'NOT met'})")
    print(calibration(pairs))
    return 0 if met else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="CUDA rows: allocated and reserved")
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows")
    parser.add_argument("--new", action="store_true", help="only the rows of issue 20's memory savers")
    parser.add_argument("--pick", type=lambda s: [int(i) for i in s.split(",")], default=None,
                        help="only these rows, by index from 0 (e.g. 8,12)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 128 on CPU, 1024 on GPU (64 rehearsing)")
    parser.add_argument("--rehearse", action="store_true", help="with --gpu: its code path on CPU, tiny models")
    parser.add_argument("--recorded", type=Path, default=None, metavar="FILE",
                        help="an earlier --gpu run's plan_accuracy.md: its measurements against today's predictions")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker[0]), Path(args.worker[1]))
        return 0
    if args_only():
        return 0
    if args.recorded:
        return recorded(args.recorded)
    import torch

    device, precision = ("cuda", "bf16") if args.gpu else ("cpu", "fp32")
    if args.gpu and args.rehearse:
        device = "cpu"
    elif args.gpu and not torch.cuda.is_available():
        print("error: --gpu needs a CUDA GPU; run without --gpu for the CPU rows (or add --rehearse)", file=sys.stderr)
        return 2
    seq = args.seq_len or (64 if args.rehearse else 1024 if args.gpu else 128)
    gpus = torch.cuda.device_count() if device == "cuda" else 1
    float8_capable = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    rows = (GPU_ROWS if args.gpu else NEW_ROWS if args.new else CPU_ROWS)[:args.rows]
    if args.pick:
        rows = [rows[i] for i in args.pick]
    gpu = f" | {torch.cuda.get_device_name(0)} x {gpus}" if device == "cuda" else ""
    note = " | rehearsal: tiny models on CPU, live-tensor peak in place of allocated/reserved" if args.rehearse else ""
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {platform.node()} | {os.cpu_count()} CPUs | torch {torch.__version__}"
          f"{gpu} | seq {seq} | {precision}{note}")
    kinds = ["allocated", "reserved"] if args.gpu else ["live_peak"]
    print("| model | ranks | sharding | checkpointing | LoRA | micro-batch | other | "
          + " | ".join(f"predicted {k} MiB | measured {k} MiB | error" for k in kinds) + " | trace s |")
    print("|---|---|---|---|---|---|---|" + "---|---|---|" * len(kinds) + "---|")
    worst, under, over, measured = 0.0, 0.0, 0.0, []
    with tempfile.TemporaryDirectory() as tmp:
        for shape, ranks, sharding, ac, lora, mb, *more in rows:
            extra = tuple(more[0]) if more else ()
            spec = dict(shape=shape, ranks=ranks or gpus, sharding=sharding, ac=ac, lora=lora, mb=mb, seq=seq,
                        device=device, precision=precision, target="cuda" if args.gpu else "cpu", tiny=args.rehearse,
                        extra=extra)
            if spec["ranks"] == 1 and sharding == "no_shard":
                continue
            why_not = ("float8 needs a GPU of compute capability 8.9+"
                       if any(e.startswith("float8=") for e in extra) and not float8_capable else
                       "QLoRA needs bitsandbytes (QLORA=1 bash bench/gpu/wheels.sh)"
                       if "peft.quantize=4bit" in extra and importlib.util.find_spec("bitsandbytes") is None else "")
            if why_not:
                print(f"| {shape} | {spec['ranks']} | {sharding} | {ac} | {'yes' if lora else 'no'} | {mb} | "
                      f"{' '.join(extra)} | skipped: {why_not} |", flush=True)
                continue
            pred, real = predict(spec), measure(spec, Path(tmp))
            if args.rehearse:
                real.update(allocated=real["live_peak"], reserved=real["live_peak"])
            measured.append((pred, real))
            line, errors = table_row(spec, pred, real, kinds)
            worst = max([worst, *map(abs, errors)])
            under, over = max([under, *(-e for e in errors)]), max([over, *errors])
            print(f"{line} {pred['trace_s']:.1f} |", flush=True)
    if args.gpu:
        print(f"worst error {100 * worst:.1f} % (goal: within 10 %: {'met' if worst <= 0.10 else 'NOT met'})")
    else:
        met = under <= 0.01 and over <= 0.03
        print(f"most under {100 * under:.1f} %, most over {100 * over:.1f} % (goal: under by at most 1 %, over by "
              f"at most 3 %: {'met' if met else 'NOT met'})")
    if args.gpu and measured:
        print(calibration(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
