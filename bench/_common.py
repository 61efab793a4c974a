"""Helpers shared by the benchmarks: assets, launching ranks, memory probes, state bytes, tables.

Kept free of benchmark logic so each benchmark file reads top to bottom on its own.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
MB = 1024 ** 2


def default_workdir() -> Path:
    """Scratch space for run folders and per-rank JSON (outside the repository)."""
    return Path(os.environ.get("SHARDTUNE_BENCH_DIR", "/tmp/shardtune-bench"))


def args_only() -> bool:
    """`ARGS_ONLY=1 bash bench/gpu/run.sh`: each benchmark parses its command line and stops there,
    so a suite's command lines are checked in seconds, before a GPU's minutes are spent on them."""
    return bool(os.environ.get("SHARDTUNE_BENCH_ARGS_ONLY"))


def quickstart_assets(vocab_size: int = 2048) -> dict:
    """The offline docstring corpus + BPE tokenizer (built once, then reused from the cache)."""
    from shardtune.data.quickstart import build_quickstart_assets, default_cache_dir

    return build_quickstart_assets(default_cache_dir(), vocab_size=vocab_size)


def overrides_from(tree: dict, prefix: str = "") -> list[str]:
    """Nested dict -> shardtune `key=value` overrides (dicts under model.config stay JSON)."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "model.config":
            out += overrides_from(value, name + ".")
        else:
            as_json = isinstance(value, (dict, list, bool)) or value is None
            out.append(f"{name}={json.dumps(value) if as_json else value}")
    return out


def threads_per_rank(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def torchrun_env(nproc: int, env: dict | None = None) -> dict:
    """The environment of a benchmark's ranks: their share of the cores, offline, unbuffered."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(nproc)), "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}


def torchrun(script: Path, nproc: int, args: list[str], timeout: int = 900, env: dict | None = None):
    """Start `nproc` ranks of `script` with torch's launcher; returns the CompletedProcess."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=torchrun_env(nproc, env))


def last_error_line(proc) -> str:
    """The most telling line of a failed run's output (the last exception line, else the last line)."""
    errors = [line.strip() for line in (proc.stderr or "").splitlines() if line.strip()]
    lines = errors + [line.strip() for line in (proc.stdout or "").splitlines() if line.strip()]
    for line in lines:  # the first exception raised by a rank is the cause; the launcher's come later
        if re.match(r"^(\[rank\d+\]: ?)?[\w.]*(Error|Exception)\b.*:", line) and "ChildFailedError" not in line:
            return line[:300]
    # else stderr's last line (shardtune's one-line refusals go there), not stdout's progress
    last = errors or lines
    return last[-1][:300] if last else f"exit code {proc.returncode}"


def peak_memory_bytes(device_type: str) -> int:
    """CUDA: max_memory_allocated; CPU: this process's peak resident set size (ru_maxrss, KiB on Linux)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_rank_json(folder: Path, tag: str, record: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{tag}.rank{rank}.json").write_text(json.dumps(record))


def read_rank_json(folder: Path, tag: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{tag}.rank*.json"))]


def machine_line() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    try:
        import accelerate

        versions += f", accelerate {accelerate.__version__}"
    except ImportError:
        pass
    return (f"{time.strftime('%Y-%m-%d %H:%M %Z')} | {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {gpu} | "
            f"Python {platform.python_version()}, {versions}")


# A model config shrunk to a tiny one of the same architecture (--rehearse: a GPU benchmark's code
# path, run on CPU in seconds); each key that sets a size gets the tiny size
TINY_SIZES = {"num_hidden_layers": 2, "n_layer": 2, "hidden_size": 64, "n_embd": 64, "word_embed_proj_dim": 64,
              "intermediate_size": 128, "ffn_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "n_head": 4, "vocab_size": 2048}


def tiny_model(model_config: dict) -> dict:
    return {k: TINY_SIZES.get(k, v) for k, v in model_config.items()}


def markdown_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def weighted_sums(ids):
    """One number per micro-batch that changes if any block, or any token's place, differs."""
    import torch

    pos = torch.arange(1, ids.shape[-1] + 1, device=ids.device, dtype=torch.int64)
    return (ids.to(torch.int64) * pos).sum()


def flops_per_token(model_config: dict, tokenizer: str, seq_len: int) -> float:
    """shardtune's own count (telemetry.flops_per_token over the matmul weights), all trainable."""
    from shardtune.config.schema import ModelConfig
    from shardtune.model.hf import build_meta_model, load_hf_config
    from shardtune.telemetry.flops import flops_per_token as count
    from shardtune.telemetry.flops import matmul_params

    hf = load_hf_config(ModelConfig(config=model_config, tokenizer=tokenizer))
    return count(matmul_params(build_meta_model(hf))[0], hf, seq_len)
