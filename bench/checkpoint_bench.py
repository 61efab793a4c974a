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
    from transformers import AutoTokenizer

    from shardtune.checkpoint.dcp import Checkpointer, ModelOptimizerState
    from shardtune.config.schema import CheckpointConfig, ModelConfig, TrainConfig
    from shardtune.data.quickstart import build_quickstart_assets
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.distributed.process_group import init_distributed
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.model.hf import load_hf_config, load_source_model
    from shardtune.train.optim import build_optimizer
    from shardtune.train.state import TrainState

    # No Trainer: the model, the optimizer and the checkpointer's explicit state objects.
    d = init_distributed("cpu")
    world = d.world_size
    scratch = Path(args.out or os.path.join(tempfile.gettempdir(), f"shardtune-ckpt-bench-{world}"))
    model_cfg = ModelConfig(config=dict(GPT2_SMALL))
    hf_config = load_hf_config(model_cfg)
    spec = ModelSpec(hf_config)
    model = build_model(spec, build_mesh(spec.fsdp, d), d.device, source=lambda: load_source_model(
        model_cfg, hf_config, seed=0)).model
    optimizer = build_optimizer(model, TrainConfig(), d.device)
    model(input_ids=torch.zeros(1, 64, dtype=torch.long)).logits.float().mean().backward()
    optimizer.step()  # the optimizer now holds its moment buffers
    progress = TrainState(step=1)
    assets = build_quickstart_assets(scratch.parent / "shardtune-bench-assets", vocab_size=300, max_docs=400)
    tokenizer = AutoTokenizer.from_pretrained(assets["tokenizer"])

    def write_extras(folder: Path) -> None:  # what export needs beside the shards
        hf_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder / "tokenizer")

    def checkpointer(async_save: bool) -> Checkpointer:
        return Checkpointer(scratch / "checkpoints", CheckpointConfig(keep_last=1, async_save=async_save),
                            ModelOptimizerState(model, optimizer), {"train_state": progress},
                            describe=lambda step: {"config": {}}, write_extras=write_extras)

    def timed_saves(async_save: bool, first_step: int) -> dict:
        ckpt = checkpointer(async_save)
        blocking, total = [], []
        for i in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(first_step + i)
            blocking.append(time.perf_counter() - start)
            ckpt.wait()
            dist.barrier()
            total.append(time.perf_counter() - start)
        ckpt.close()
        return {"blocking_s": statistics.median(blocking), "total_s": statistics.median(total)}

    result = {"world_size": world, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
              "torch_threads": torch.get_num_threads(),
              "sync": timed_saves(False, 100), "async": timed_saves(True, 200)}
    latest = scratch / "checkpoints" / f"step-{200 + args.repeat - 1:06d}"
    result["checkpoint_MB"] = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) / 2**20

    loads, ckpt = [], checkpointer(False)
    for _ in range(args.repeat):
        dist.barrier()
        start = time.perf_counter()
        ckpt.load(latest)
        dist.barrier()
        loads.append(time.perf_counter() - start)
    result["load_s"] = statistics.median(loads)

    if d.is_main:
        from shardtune.checkpoint.export import export_checkpoint

        folder = scratch / "export"
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        export_checkpoint(str(latest), folder)
        result["export_s"] = time.perf_counter() - start
        print(json.dumps(result, indent=1), flush=True)
    dist.destroy_process_group()
    if d.is_main:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
