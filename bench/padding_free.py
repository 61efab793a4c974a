"""Padding-free batches vs padded batches on alpaca-shaped instruction data: tokens/s of real
(non-padding) tokens, and the losses of both (they must agree to 1e-5 in fp32).

The fixture: 2000 examples whose instruction, optional input (40 % of them) and response
lengths in words are log-normal like alpaca-cleaned's (medians about 13, 20 and 50 words, the
responses with a long tail, cut at data.cutoff_len=512 tokens), words drawn from the quickstart
docstrings. The model: a random-init Llama (4 layers, 512 wide, the quickstart's 2048-token
vocabulary; `--model llama256` is 256 wide), micro-batch 8, global 16, fp32, one process, sdpa.
Each layout runs `--repeats` times, alternating; tokens/s counts only real tokens, over the steps after `--skip`
(from `step_time_s` and `tokens_seen` in metrics.jsonl). `padded+grouped` (data.group_by_length)
is shown for reference: its batches differ, so its losses do too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# 512 wide: the linear layers outweigh attention per token, as in the models people fine-tune
# (a padding-free row is one long sequence, and sdpa/eager on CPU compute its attention densely)
MODELS = {"llama512": {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1376,
                       "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 512},
          "llama256": {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512}}
LAYOUTS = {"padded": {}, "padding_free": {"data": {"padding_free": True}},
           "padded+grouped": {"data": {"group_by_length": True}}}


def alpaca_like(path: Path, source_words: list[str], n: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)

    def words(median: float, sigma: float, cap: int) -> str:
        k = max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))
        return " ".join(rng.choices(source_words, k=k))

    with open(path, "w") as f:
        for _ in range(n):
            row = {"instruction": words(13, 0.5, 80), "input": words(20, 0.9, 300) if rng.random() < 0.4 else "",
                   "output": words(50, 1.0, 600)}
            f.write(json.dumps(row) + "\n")


def run(layout: str, model: dict, data: Path, tokenizer: str, out: Path, steps: int) -> list[dict]:
    tree = {"model": {"config": model, "tokenizer": tokenizer},
            "data": {"path": str(data), "format": "instruct", "seq_len": 512, "val_size": 16,
                     **LAYOUTS[layout].get("data", {})},
            "train": {"micro_batch_size": 8, "global_batch_size": 16, "max_steps": steps, "lr": 1e-3,
                      "warmup_steps": 2, "seed": 42},
            "eval": {"at_start": False, "max_batches": 1}, "log": {"every_steps": 1, "progress": False},
            "output_dir": str(out)}
    proc = subprocess.run([C.PYTHON, "-m", "shardtune", "train", *C.overrides_from(tree), "--overwrite"],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{layout}: {C.last_error_line(proc)}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def real_tokens_per_s(records: list[dict], skip: int) -> float:
    steps = [r for r in records if r.get("loss") is not None]
    tokens = [b["tokens_seen"] - a["tokens_seen"] for a, b in zip(steps, steps[1:])]
    seconds = [b["step_time_s"] for b in steps[1:]]
    return sum(tokens[skip:]) / sum(seconds[skip:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama512")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--workdir", type=Path, default=C.default_workdir() / "padding_free")
    args = parser.parse_args()
    assets = C.quickstart_assets()
    text = " ".join(json.loads(line)["text"] for line in open(assets["train"]))
    vocab = [w for w in text.split() if w.isalpha()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    data = args.workdir / "alpaca_like.jsonl"
    alpaca_like(data, vocab)
    print(C.machine_line())
    layouts = [name for name in LAYOUTS if name in args.layouts]
    print(f"model {args.model}: {MODELS[args.model]}")
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    losses: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for name in layouts:
            print(f"repeat {r}, {name} (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
            records = run(name, MODELS[args.model], data, assets["tokenizer"], args.workdir / name, args.steps)
            rates[name].append(real_tokens_per_s(records, args.skip))
            losses[name] = [x["loss"] for x in records if x.get("loss") is not None]
    base = statistics.median(rates["padded"])
    rows = []
    for name in layouts:
        diff = max(abs(a - b) for a, b in zip(losses[name], losses["padded"]))
        rows.append([name, " / ".join(f"{x:.0f}" for x in rates[name]), f"{statistics.median(rates[name]):.0f}",
                     f"{statistics.median(rates[name]) / base:.2f}×",
                     f"{diff:.1e}" if name != "padded+grouped" else "(other batches)",
                     f"{losses[name][0]:.4f} → {losses[name][-1]:.4f}"])
    print(C.markdown_table(
        ["layout", "real tokens/s per run", "median", "vs padded", "max |loss - padded loss|", "loss first → last"],
        rows))


if __name__ == "__main__":
    main()
