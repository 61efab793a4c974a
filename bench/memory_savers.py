"""Issue 20's memory savers on CPU: optimizer-state bytes per parameter, peak live bytes and step
time of each activation setting, and the quality of low-precision optimizer states.

    python bench/memory_savers.py states        # GPT-2 small: moment bytes per trainable parameter
    python bench/memory_savers.py activations   # GPT-2 small, seq 512, 1 rank: none/selective/every_n/full/offload
    python bench/memory_savers.py quality       # quickstart, 300 steps: fp32 vs bf16 vs 8bit moments
    python bench/memory_savers.py activations --micro-batch 8 precision=bf16    # on a GPU (device=auto)

`states` runs torchao's step eagerly (torch.compile -> identity: the bytes do not depend on it);
`quality` runs the real (compiled) step through `python -m shardtune train`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_scaling import GPT2_SMALL  # noqa: E402

import _common as C  # noqa: E402

ACTIVATIONS = {"none": [], "selective": ["activation_checkpointing=selective"],
               "every_n (n=2)": ["activation_checkpointing=every_n", "activation_checkpointing_every=2"],
               "full": ["activation_checkpointing=full"], "offload": ["activation_offload=true"]}


def states() -> str:
    __import__("shardtune")  # first: it quiets torchao's import warnings (transformers imports torchao)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardtune.config.schema import TrainConfig
    from shardtune.train.optim import build_optimizer, optimizer_state_bytes

    torch.compile = lambda fn, **kw: fn
    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in GPT2_SMALL.items() if k != "model_type"}))
    n = sum(p.numel() for p in model.parameters())
    rows = []
    for state in ("fp32", "bf16", "8bit", "4bit"):
        opt = build_optimizer(model, TrainConfig(optimizer_state=state), torch.device("cpu"))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        rows.append([state, f"{optimizer_state_bytes(opt) / n:.3f}", f"{optimizer_state_bytes(opt) / 2**20:,.0f}"])
        del opt
    return f"GPT-2 small, {n:,} parameters\n" + C.markdown_table(["optimizer_state", "bytes/param", "MiB"], rows)


def run_train(out: Path, extra: list[str], reuse: bool = False, nproc: int = 1) -> list[dict]:
    """`shardtune train` into `out`; with `reuse`, a finished run already there is read instead."""
    if reuse and (out / "metrics.jsonl").is_file() and (out / "final").exists() and \
            any("eval_loss" in line for line in (out / "metrics.jsonl").read_text().splitlines()[-1:]):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cmd = [C.PYTHON, "-m", "shardtune", "train", *extra, f"output_dir={out}", "--overwrite", "--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.BENCH_DIR.parent)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def activations(work: Path, steps: int, micro_batch: int, extra_overrides: list[str], nproc: int = 1) -> str:
    assets = C.quickstart_assets()
    tree = {"model": {"config": GPT2_SMALL, "tokenizer": assets["tokenizer"]},
            "data": {"path": str(Path(assets["train"]).parent), "seq_len": 512},
            "train": {"micro_batch_size": micro_batch, "global_batch_size": micro_batch * nproc, "max_steps": steps,
                      "lr": 1e-4},
            "eval": {"at_start": False, "every_steps": 0, "max_batches": 1}, "save_final": False,
            "log": {"every_steps": 1, "progress": False, "live_memory": 1}}
    rows = []
    for name, extra in ACTIVATIONS.items():
        records = run_train(work / name.split()[0], [*C.overrides_from(tree), *extra, *extra_overrides], nproc=nproc)
        steps_ = [r for r in records if r.get("loss") is not None]
        peak = max(r.get("mem_live_peak_gib", 0) for r in records)
        later = [r["step_time_s"] for r in steps_[1:] if "step_time_s" in r]  # step 1 runs under MemTracker
        rows.append([name, f"{peak:.3f}", f"{sum(later) / max(len(later), 1):.2f}", f"{steps_[-1]['loss']:.6f}"])
    return C.markdown_table(["activations", "peak live GiB", "step s", f"loss at step {steps}"], rows)


def quality(work: Path, steps: int, extra_overrides: list[str], reuse: bool) -> str:
    rows, curves = [], {}
    for state in ("fp32", "bf16", "8bit"):
        records = run_train(work / f"q-{state}", [f"train.optimizer_state={state}", f"train.max_steps={steps}",
                                                       *extra_overrides], reuse)
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        curves[state] = evals
        rows.append([state, f"{evals[-1][1]:.4f}"])
    base = float(rows[0][1])
    for row in rows:
        row.append(f"{(float(row[1]) - base) / base * 100:+.2f} %")
    table = C.markdown_table(["optimizer_state", "final validation loss", "vs fp32"], rows)
    curve = "\n".join(f"{s}: " + ", ".join(f"{st}:{v:.3f}" for st, v in c) for s, c in curves.items())
    return table + "\n\nvalidation curves (step:loss)\n" + curve


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["states", "activations", "quality"])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--reuse", action="store_true", help="quality: read runs already finished in --work")
    p.add_argument("--micro-batch", type=int, default=1, help="activations: sequences per step and rank")
    p.add_argument("--nproc", type=int, default=1, help="activations: ranks (FSDP2 full_shard)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more shardtune overrides, e.g. precision=bf16")
    a = p.parse_args()
    work = a.work or C.default_workdir() / "memory_savers"
    print(C.machine_line())
    if a.what == "states":
        print(states())
    elif a.what == "activations":
        print(activations(work, a.steps or 3, a.micro_batch, a.overrides, a.nproc))
    else:
        print(quality(work, a.steps or 300, a.overrides, a.reuse))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
