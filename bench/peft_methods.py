"""Issue 24's table: every `peft.method` on one small real fine-tune on CPU, side by side with
full fine-tuning — trainable parameters, peak live memory, tokens/s, validation loss.

    python bench/peft_methods.py                 # base: the quickstart GPT-2 pre-trained 300 steps
    python bench/peft_methods.py --steps 100 --reuse

The base is the quickstart (random-init 2-layer GPT-2 on the offline docstring corpus: English
prose) trained from scratch, then saved (`final/`); every method fine-tunes that base on another
domain, the standard library's own Python source (the same tokenizer; files split by name into
train and validation), for the same steps, batch and schedule, each at a learning rate usual for
it (METHODS below), and the validation loss on held-out source files is compared. One rank,
fp32, `log.live_memory` for the peak of live tensors over the first step (MemTracker), tokens/s
the mean of the steps after it (all runs one after another: compare them within one table).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# method -> (overrides, learning rate): each at a rate its authors or peft's examples use
# (prompt-learning methods train a few thousand numbers and want a much larger one)
METHODS = {
    "full fine-tune": ([], 1e-3),
    "lora": (["peft.method=lora"], 3e-3),
    "lora rslora": (["peft.method=lora", "peft.rslora=true"], 3e-3),
    "lora pissa": (["peft.method=lora", "peft.init=pissa"], 3e-3),
    "lora olora": (["peft.method=lora", "peft.init=olora"], 3e-3),
    "lora+ (ratio 16)": (["peft.method=lora", "peft.lora_plus_ratio=16"], 3e-3),
    "dora": (["peft.method=dora"], 3e-3),
    "ia3": (["peft.method=ia3"], 1e-2),
    "prefix_tuning": (["peft.method=prefix_tuning"], 3e-2),
    "prompt_tuning": (["peft.method=prompt_tuning"], 3e-2),
    "adaption_prompt": (["peft.method=adaption_prompt"], 1e-2),
}
TRAINABLE = re.compile(r"([\d,]+) params \(([\d,]+) trainable")


def train(out: Path, overrides: list[str], reuse: bool) -> tuple[list[dict], str]:
    """`shardtune train` into `out` (or, with `reuse`, a finished run there); its records and output."""
    log = out.with_suffix(".log")
    if reuse and (out / "metrics.jsonl").is_file() and log.is_file() and "trained" in log.read_text():
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], log.read_text()
    cmd = [C.PYTHON, "-m", "shardtune", "train", *overrides, f"output_dir={out}", "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.BENCH_DIR.parent)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode == 2:  # refused for this model, in one line: the table says why
        return [], proc.stderr.strip().splitlines()[-1]
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], proc.stdout + proc.stderr


def code_corpus(folder: Path, files: int = 400) -> Path:
    """The fine-tuning data: the standard library's .py files (tests left out) as jsonl documents,
    every tenth file (by sorted name) held out for validation. Deterministic on one Python version."""
    import sysconfig

    if (folder / "validation.jsonl").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    paths = paths[:: max(1, len(paths) // files)][:files]
    split = {"train": [], "validation": []}
    for i, path in enumerate(paths):
        text = path.read_text(encoding="utf-8", errors="replace")[:20000]  # long modules: their first part
        split["validation" if i % 10 == 0 else "train"].append(json.dumps({"text": text}))
    for name, lines in split.items():
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-steps", type=int, default=300, help="pre-training steps of the base")
    p.add_argument("--steps", type=int, default=100, help="fine-tuning steps of every method")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated names of METHODS")
    p.add_argument("--work", type=Path, default=C.default_workdir() / "peft_methods")
    p.add_argument("--reuse", action="store_true", help="read runs already finished in --work")
    a = p.parse_args()
    if C.args_only():
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    train(a.work / "base", [f"train.max_steps={a.base_steps}", "eval.at_start=false"], a.reuse)
    assets = C.quickstart_assets()
    common = [f"model.name_or_path={a.work / 'base' / 'final'}", f"model.tokenizer={assets['tokenizer']}",
              f"data.path={code_corpus(a.work / 'code')}", "data.seq_len=128", "precision=fp32", "device=cpu",
              "train.micro_batch_size=8", "train.global_batch_size=16", f"train.max_steps={a.steps}",
              "train.warmup_steps=5", "eval.at_start=true", f"eval.every_steps={a.steps}", "eval.max_batches=16",
              "log.every_steps=1", "log.progress=false", "log.live_memory=1", "save_final=false"]
    rows = []
    for name in a.methods.split(","):
        extra, lr = METHODS[name]
        records, output = train(a.work / re.sub(r"\W+", "-", name).strip("-"), [*common, *extra, f"train.lr={lr}"],
                                a.reuse)
        if not records:
            rows.append([name, f"{lr:g}", output, "", "", "", "", ""])
            continue
        total, trainable = (int(g.replace(",", "")) for g in TRAINABLE.search(output).groups())
        steps = [r for r in records if r.get("loss") is not None]
        evals = [r["eval_loss"] for r in records if "eval_loss" in r]
        speed = [r["tokens_per_s"] for r in steps[1:] if "tokens_per_s" in r]  # step 1 runs under MemTracker
        peak = max(r.get("mem_live_peak_gib", 0) for r in records)
        rows.append([name, f"{lr:g}", f"{trainable:,}", f"{100 * trainable / total:.3g} %", f"{peak * 1024:.1f}",
                     f"{sum(speed) / max(len(speed), 1):,.0f}", f"{evals[0]:.4f}", f"{evals[-1]:.4f}"])
    print(C.machine_line())
    print(C.markdown_table(["method", "lr", "trainable", "share", "peak live MiB", "tokens/s", "val loss at 0",
                            f"val loss at {a.steps}"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
