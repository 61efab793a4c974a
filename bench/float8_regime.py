"""Is a step-by-step float8/bf16 loss comparison meaningful in this regime? The CUDA float8 test's
model (a 2-layer, 2048-wide Llama, vocabulary 512, seq 64, global batch 8, 12 steps) on CPU, where
torch's CPU `_scaled_mm` runs the float8 matmuls, bf16 against float8, at the suite's tiny-model
lr (1e-3, no warmup) and at lr 1e-4 with 3 warmup steps. Prints each run's losses and the worst
relative gap per step. ~6 min per bf16 run and ~18 per float8 run on 2 busy cores.

    .venv/bin/python bench/float8_regime.py [--recipes tensorwise rowwise] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 2048, "intermediate_size": 8192,
         "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 128, "vocab_size": 512}
REGIMES = {"lr 1e-3, no warmup (the suite's)": {},
           "lr 1e-4, 3 warmup steps": {"train.lr": 1e-4, "train.warmup_steps": 3}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["tensorwise"], choices=["tensorwise", "rowwise"])
    p.add_argument("--out", type=Path, default=Path("/tmp/float8_regime"))
    p.add_argument("--regimes", nargs="+", type=int, default=list(range(len(REGIMES))),
                   help="which regimes, by position (default: all)")
    a = p.parse_args()
    import torch

    from conftest import lift_float8_device_check, losses, tiny_overrides
    from shardtune.config.load import load_config
    from shardtune.data.quickstart import build_quickstart_assets
    from shardtune.train.trainer import run

    torch.set_num_threads(1)
    lift_float8_device_check()
    assets = build_quickstart_assets(a.out / "assets", vocab_size=300, max_docs=400)
    for regime, extra in [list(REGIMES.items())[i] for i in a.regimes]:
        curves = {}
        for recipe in ("none", *a.recipes):
            t0, folder = time.time(), a.out / f"{regime.split(',')[0].replace(' ', '')}-{recipe}"
            overrides = tiny_overrides(assets, folder, "llama", **{
                "model.config": json.dumps(SHAPE), "precision": "bf16", "train.max_steps": 12,
                "eval.at_start": "false", "float8": recipe, "save_final": "false", **extra})
            run(load_config(None, overrides, defaults={}), overwrite=True)
            curves[recipe] = losses(folder)
            print(f"{regime} | {recipe} | {time.time() - t0:.0f} s | {[round(x, 4) for x in curves[recipe]]}",
                  flush=True)
        for recipe in a.recipes:
            gaps = [abs(x - y) / y for x, y in zip(curves[recipe], curves["none"], strict=True)]
            print(f"{regime} | {recipe} against bf16: worst {max(gaps):.2%} (step {gaps.index(max(gaps)) + 1})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
