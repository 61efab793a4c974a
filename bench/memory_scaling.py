"""Per-rank memory of shardtune: no_shard vs full_shard on 1, 2 and 4 CPU ranks.

For each layout, torchrun starts N ranks of this file; each builds `shardtune.train.trainer.Trainer`,
trains 2 steps with fit(), runs one more forward/backward so the gradients exist, then
writes the bytes of parameters, gradients and optimizer state it holds (local shards of the
DTensors) and its peak RSS. The driver prints them next to the ideal total / N.

    python bench/memory_scaling.py                       # GPT-2 small shape, random init
    python bench/memory_scaling.py --nproc 1 2 --steps 3
    python bench/memory_scaling.py --release-freed     # RSS that follows live tensors (see below)

Peak RSS is a high-water mark of what the C allocator holds, not of live tensors: glibc keeps
freed blocks below its (self-raising) mmap threshold for reuse. --release-freed fixes that
threshold at 128 KiB, so every tensor buffer above it is its own mapping and goes back to the
OS when freed: peak RSS then follows the live bytes (plus the libraries' baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# fixed thresholds: no self-raising mmap threshold, free memory trimmed from the heap top at once
RELEASE = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
              "vocab_size": 50257}


def overrides(tokenizer: str, data_dir: str, out: Path, nproc: int, sharding: str, steps: int) -> list[str]:
    tree = {"model": {"config": GPT2_SMALL, "tokenizer": tokenizer},
            "data": {"path": data_dir, "seq_len": 128},
            # global = micro x ranks: one micro-batch per rank per step at every world size
            "train": {"micro_batch_size": 1, "global_batch_size": nproc, "max_steps": steps, "lr": 1e-4,
                      "weight_decay": 0.01},
            "fsdp": {"sharding": sharding}, "eval": {"at_start": False, "max_batches": 1},
            "log": {"every_steps": 1, "progress": False}, "output_dir": str(out)}
    return C.overrides_from(tree)


def worker(spec: dict) -> None:
    import torch.distributed.fsdp  # noqa: F401  (the baseline below includes the libraries)
    import transformers  # noqa: F401

    from shardtune.config.load import load_config
    from shardtune.data.batches import collate
    from shardtune.model.hf import count_params
    from shardtune.telemetry.metrics import state_bytes
    from shardtune.train.step import token_loss
    from shardtune.train.trainer import Trainer

    baseline = C.current_rss_bytes()  # after importing torch, transformers and shardtune
    trainer = Trainer(load_config(None, spec["overrides"]), overwrite=True)
    rss_setup, peak_setup = C.current_rss_bytes(), C.peak_memory_bytes(trainer.dist.device.type)
    t0 = time.perf_counter()
    trainer.fit()
    train_s = time.perf_counter() - t0
    # fit() ends each step with zero_grad(set_to_none=True): one more backward to measure gradients.
    dist = trainer.dist
    batch = collate(trainer.train_ds, [dist.rank], dist.device)
    loss_sum, count, _ = token_loss(trainer.model, batch)
    (loss_sum / count).backward()
    total, _ = count_params(trainer.model)
    record = {**state_bytes(trainer.model, trainer.optimizer), "total_params": total,
              "peak_bytes": C.peak_memory_bytes(dist.device.type), "baseline_rss": baseline,
              "setup_rss": rss_setup, "setup_peak": peak_setup, "train_s": train_s, "rank": dist.rank}
    C.write_rank_json(Path(spec["out"]), "mem", record)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--sharding", nargs="+", default=["no_shard", "full_shard"], choices=["no_shard", "full_shard"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--release-freed", action="store_true",
                   help="glibc returns freed tensor buffers to the OS at once (MALLOC_MMAP_THRESHOLD_=131072)")
    p.add_argument("--workdir", type=Path, default=C.default_workdir() / "memory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(Path(a.spec).read_text()))
        return 0

    a.workdir.mkdir(parents=True, exist_ok=True)
    assets = C.quickstart_assets()
    data_dir = str(Path(assets["train"]).parent)
    released = " | freed buffers returned to the OS (" + " ".join(f"{k}={v}" for k, v in RELEASE.items()) + ")"
    print(f"# shardtune per-rank memory: no_shard vs full_shard\n\n{C.machine_line()}\n\n"
          f"model GPT-2 small shape {json.dumps(GPT2_SMALL)}, random init, fp32 | seq 128 | micro 1 per rank | "
          f"{a.steps} steps via Trainer.fit(), then one more backward for the gradients"
          f"{released if a.release_freed else ''}\n", flush=True)
    rows = []
    for sharding in a.sharding:
        for nproc in a.nproc:
            out = a.workdir / f"{sharding}-{nproc}"
            spec = {"out": str(out), "overrides": overrides(assets["tokenizer"], data_dir, out / "run", nproc,
                                                             sharding, a.steps)}
            spec_path = a.workdir / f"{sharding}-{nproc}.json"
            spec_path.write_text(json.dumps(spec))
            for old in out.glob("mem.rank*.json"):
                old.unlink()
            t0 = time.perf_counter()
            proc = C.torchrun(Path(__file__), nproc, ["--worker", "--spec", str(spec_path)],
                              env=RELEASE if a.release_freed else None)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                print(f"  {sharding} x{nproc}: FAILED: {C.last_error_line(proc)}", flush=True)
                rows.append([sharding, nproc, "failed: " + C.last_error_line(proc)] + [""] * 10)
                continue
            ranks = C.read_rank_json(out, "mem")
            full = ranks[0]["total_params"] * 4  # fp32 bytes of one whole copy
            ideal = 4 * full / nproc  # params + grads + 2 Adam moments, split evenly
            worst = max(ranks, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"])
            state = worst["param_bytes"] + worst["grad_bytes"] + worst["optim_bytes"]
            mb = lambda x: f"{x / C.MB:.0f}"  # noqa: E731
            peaks = [r["peak_bytes"] for r in ranks]
            rows.append([sharding, nproc, mb(worst["param_bytes"]), mb(worst["grad_bytes"]), mb(worst["optim_bytes"]),
                         mb(state), mb(ideal), f"{state / ideal:.2f}", mb(max(peaks)), mb(min(peaks)),
                         mb(max(r["setup_peak"] for r in ranks)), mb(max(r["baseline_rss"] for r in ranks)),
                         f"{wall:.0f}"])
            print(f"  {sharding} x{nproc}: state {mb(state)} MB/rank (ideal {mb(ideal)}), "
                  f"peak RSS {mb(max(peaks))} MB, {wall:.0f}s", flush=True)
    headers = ["sharding", "ranks", "params MB/rank", "grads MB/rank", "optim MB/rank", "state MB/rank",
               "ideal total/N MB", "state / ideal", "peak RSS max MB", "peak RSS min MB", "peak RSS by end of setup MB",
               "RSS after imports MB",
               "wall s"]
    print("\n## Results (per rank = the rank holding the most; MB = 2^20 bytes)\n")
    print(C.markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
