"""shardtune alone on vs_hf_trainer.py's Llama ~1B setup, once per variant (extra overrides), each
step's loss and gradient norm side by side; with --equal REL, exit 1 unless every variant's
losses equal the first's within REL (relative) at every step and are finite.

    python bench/gpu/variants.py --steps 4 --equal 1e-3 plain= offload=fsdp.cpu_offload=true
    python bench/gpu/variants.py --steps 16 nan=on_nan=skip plain-head=on_nan=skip,loss_chunk_tokens=0
    python bench/gpu/variants.py --rehearse ...      (the same code path, tiny, on CPU)

A variant is NAME=KEY=VALUE[,KEY=VALUE...]; a step skipped as non-finite (on_nan=skip) shows
its loss as None and the warning's origin (which gradients, which samples) below the table."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vs_hf_trainer as V  # noqa: E402

import _common as C  # noqa: E402


def run_variant(name: str, extra: list[str], setup: dict, workdir: Path) -> dict:
    assets = C.quickstart_assets()
    out = workdir / name
    overrides = V.shardtune_overrides(setup, assets["tokenizer"], str(Path(assets["train"]).parent), out, 1,
                                      "full_shard") + extra
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", *overrides, "save_final=false", "--overwrite"],
                          capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    rows = [r for r in rows if "loss" in r]
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                if "gradient norm" in line and ("warning" in line or "error" in line)]
    times = sorted(r["step_time_s"] for r in rows[2:] if r.get("step_time_s"))  # the first two: warm-up
    return {"rc": proc.returncode, "seconds": time.time() - t0, "losses": [r["loss"] for r in rows],
            "step_s": times[len(times) // 2] if times else None,
            "grad_norms": [r.get("grad_norm") for r in rows], "warnings": warnings,
            "error": C.last_error_line(proc) if proc.returncode else None,
            "tail": proc.stderr.splitlines()[-40:] if proc.returncode else []}


def step_note(r: dict) -> str:
    return f", median step {r['step_s']:.3f} s (steps 3 on)" if r["step_s"] else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", metavar="NAME=OVERRIDES")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--equal", type=float, metavar="REL", help="every variant's losses within REL of the first's")
    p.add_argument("--rehearse", action="store_true")
    p.add_argument("--workdir", type=Path, default=C.default_workdir() / "variants")
    a = p.parse_args()
    if C.args_only():
        return 0
    setup = V.resolve_setup("gpu", a.steps, a.global_batch, a.rehearse)
    if a.rehearse:
        setup["precision"] = "fp32"  # bf16 on a CPU without bf16 units only measures emulation
    variants = {}
    for item in a.variants:
        name, _, extra = item.partition("=")
        variants[name] = [kv for kv in extra.split(",") if kv]
    print(f"# shardtune variants on the Llama ~1B setup ({'rehearsal, ' if a.rehearse else ''}{a.steps} steps, "
          f"global {setup['global']}, seq {setup['seq_len']}, {setup['precision']})\n\n{C.machine_line()}\n",
          flush=True)
    results = {}
    for name, extra in variants.items():
        results[name] = run_variant(name, extra, setup, a.workdir)
        r = results[name]
        print(f"- {name} ({' '.join(extra) or 'as the setup'}): exit {r['rc']}, {r['seconds']:.0f}s"
              f"{step_note(r)}"
              f"{', ' + r['error'] if r['error'] else ''}", flush=True)
    steps = max(len(r["losses"]) for r in results.values())
    rows = [[i + 1, *[f"{r['losses'][i]} / {r['grad_norms'][i]}" if i < len(r["losses"]) else "-"
                      for r in results.values()]] for i in range(steps)]
    print("\n" + C.markdown_table(["step", *[f"{n}: loss / grad norm" for n in results]], rows))
    for name, r in results.items():
        for line in r["warnings"]:
            print(f"\n{name}: {line}")
        if r["tail"]:  # a crash's traceback (run with CUDA_LAUNCH_BLOCKING=1 for the faulting kernel's)
            print(f"\n{name}: the last lines of its stderr\n```\n" + "\n".join(r["tail"]) + "\n```")
    if a.equal is None:
        return 0
    first, *others = results.values()
    ok = all(r["rc"] == 0 and len(r["losses"]) == len(first["losses"]) == a.steps for r in results.values())
    for r in others:
        for x, y in zip(r["losses"], first["losses"], strict=False):
            ok = ok and x is not None and y is not None and math.isfinite(x) and abs(x - y) <= a.equal * abs(y)
    print(f"\nevery variant within {a.equal:g} of {next(iter(results))} at every step: {'✅' if ok else '❌'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
