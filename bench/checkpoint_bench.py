"""Checkpoint cost for a GPT-2-small-shaped model (124M parameters, random init) with AdamW
state: save time, blocking time of a synchronous vs an asynchronous save, resume-load time,
and `shardtune export` time.

    python bench/checkpoint_bench.py [--out DIR] [--repeat 3]                    # 1 rank
    python -m torch.distributed.run --nproc-per-node 2 bench/checkpoint_bench.py  # 2 ranks

Prints one JSON object (rank 0). Times are the median of --repeat saves, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
              "vocab_size": 50257}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from shardtune.checkpoint import Checkpointer
    from shardtune.config import load_config
    from shardtune.quickstart import build_quickstart_assets
    from shardtune.train import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    scratch = Path(args.out or os.path.join(tempfile.gettempdir(), f"shardtune-ckpt-bench-{world}"))
    assets = build_quickstart_assets(scratch.parent / "shardtune-bench-assets", vocab_size=300, max_docs=400)
    cfg = load_config(None, [
        f"model.config={json.dumps(GPT2_SMALL)}", f"model.tokenizer={assets['tokenizer']}",
        f"data.path={Path(assets['train']).parent}", "data.seq_len=64", "train.micro_batch_size=1",
        f"train.global_batch_size={world}", "train.max_steps=1", "eval.at_start=false", "eval.max_batches=1",
        "log.progress=false", "device=cpu", f"output_dir={scratch / 'run'}", "checkpoint.keep_last=1"])
    trainer = Trainer(cfg, overwrite=True)
    trainer.fit()  # one step, so the optimizer holds its moment buffers

    def timed_saves(async_save: bool, first_step: int) -> dict:
        trainer.cfg.checkpoint.async_save = async_save
        trainer.ckpt.close()
        trainer.ckpt = Checkpointer(trainer)
        blocking, total = [], []
        for i in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            trainer.ckpt.save(first_step + i)
            blocking.append(time.perf_counter() - start)
            trainer.ckpt.wait()
            dist.barrier()
            total.append(time.perf_counter() - start)
        return {"blocking_s": statistics.median(blocking), "total_s": statistics.median(total)}

    result = {"world_size": world, "params_M": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
              "torch_threads": torch.get_num_threads(),
              "sync": timed_saves(False, 100), "async": timed_saves(True, 200)}
    latest = trainer.ckpt.root / f"step-{200 + args.repeat - 1:06d}"
    result["checkpoint_MB"] = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) / 2**20

    loads = []
    for _ in range(args.repeat):
        dist.barrier()
        start = time.perf_counter()
        trainer.ckpt.load(latest)
        dist.barrier()
        loads.append(time.perf_counter() - start)
    result["load_s"] = statistics.median(loads)

    if trainer.dist.is_main:
        from shardtune.export import export_checkpoint

        folder = scratch / "export"
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        export_checkpoint(str(latest), folder)
        result["export_s"] = time.perf_counter() - start
        print(json.dumps(result, indent=1), flush=True)
    trainer.close()
    if trainer.dist.is_main:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
