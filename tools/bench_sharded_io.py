"""Peak host RSS and wall time per rank for loading a model and writing final/, rank 0's path
(load + broadcast, gather + save_pretrained) against the sharded one (model.sharded_load,
checkpoint.sharded_final). Numbers for BENCHMARKS.md, not a test.

    python tools/bench_sharded_io.py make FOLDER            # GPT-2 (124M) shape, random, fp32
    torchrun --standalone --nproc_per_node=N tools/bench_sharded_io.py run FOLDER OUT {rank0,sharded} [SHARD_SIZE]
    python tools/bench_sharded_io.py same FINAL_A FINAL_B   # the two folders' tensors bitwise equal
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path


def rss() -> tuple[int, int]:
    """(current, peak since the last reset) resident set in bytes."""
    text = Path("/proc/self/status").read_text()
    get = lambda key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024  # noqa: E731
    return get("VmRSS"), get("VmHWM")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's reset of VmHWM to the current RSS


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if sys.argv[1] == "make":
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2")).save_pretrained(sys.argv[2])
        return
    if sys.argv[1] == "same":
        a, b = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in sys.argv[2:4])
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(json.dumps({"same": same, "tensors": len(a)}))
        sys.exit(0 if same else 1)
    folder, out, mode = sys.argv[2:5]
    shard_size = sys.argv[5] if len(sys.argv) > 5 else "2GB"  # final/'s max_shard_size
    import torch.distributed as dist

    from shardtune.checkpoint.export import gather_full_state_dict, save_hf_folder
    from shardtune.checkpoint.final import save_final_sharded
    from shardtune.config.schema import FSDPConfig, ModelConfig
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.distributed.process_group import init_distributed
    from shardtune.fsio import atomic_dir
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.model.hf import load_hf_config, load_source_model
    from shardtune.model.hf_sharded_io import local_safetensors_folder

    d = init_distributed("cpu")
    cfg = ModelConfig(name_or_path=folder)
    hf_config = load_hf_config(cfg)
    spec = ModelSpec(hf_config)
    mesh = build_mesh(FSDPConfig(), d)
    dist.barrier()
    base, _ = rss()
    reset_peak()
    t = time.perf_counter()
    if mode == "sharded":
        built = build_model(spec, mesh, d.device, folder=local_safetensors_folder(folder))
    else:
        built = build_model(spec, mesh, d.device, source=lambda: load_source_model(cfg, hf_config, 0))
    dist.barrier()
    load_s, (_, load_peak) = time.perf_counter() - t, rss()
    final = Path(out) / f"final-{mode}-{d.world_size}"
    reset_peak()
    before, _ = rss()
    t = time.perf_counter()
    if mode == "sharded":
        save_final_sharded(built.model, hf_config, None, final, shard_size)
    else:
        full = gather_full_state_dict(built.model)
        if d.is_main:
            with atomic_dir(final, replace=True) as tmp:
                save_hf_folder(full, hf_config, None, tmp, shard_size)
        del full
    dist.barrier()
    save_s, (_, save_peak) = time.perf_counter() - t, rss()
    row = {"mode": mode, "world": d.world_size, "rank": d.rank, "loaded": built.loaded,
           "baseline_MiB": base >> 20, "load_peak_MiB": load_peak >> 20, "load_s": round(load_s, 2),
           "save_start_MiB": before >> 20, "save_peak_MiB": save_peak >> 20,
           "save_peak_above_start_MiB": (save_peak - before) >> 20, "save_s": round(save_s, 2),
           "node": os.environ.get("GROUP_RANK", "0")}
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
