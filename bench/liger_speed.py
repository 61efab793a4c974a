"""Liger-Kernel (kernels=liger) against shardtune's own path on one GPU: tokens/s, peak memory and
the loss curve of the same fine-tune, eager and compiled.

The Llama ~1B shape of `vs_hf_trainer.py --gpu` (seq 2048, bf16, random init, the quickstart
corpus), `--steps` optimizer steps per arm, the arms in order `--repeats` times so drift hits all:
plain (HF's modules, the chunked head loss), liger (Liger's RMSNorm, rotary, SwiGLU and fused
linear cross-entropy), and both with compile=true (decoder blocks compiled).

    python bench/liger_speed.py                   # on a CUDA GPU with the liger extra installed
    python bench/liger_speed.py --rehearse        # the same code path, tiny, on CPU: the plain arms
                                                  # train, the liger arms must be refused in one line
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from float8_speed import arms_parser, paired_losses, run_arms, tokens_per_s  # noqa: E402

import _common as C  # noqa: E402

# the eager arms say so: compile=auto, the default, compiles on the GPU
ARMS = {"plain": ["compile=false"], "liger": ["kernels=liger", "compile=false"], "plain-compiled": ["compile=true"],
        "liger-compiled": ["kernels=liger", "compile=true"]}


def row(arm: str, repeat: int, run: dict, tokens_per_step: int, skip: int, base: dict | None) -> list:
    if "steps" not in run:
        return [arm, repeat, "", "", "", "", "", f"{'refused' if 'refused' in run else 'error'}: "
                f"{run.get('refused') or run.get('error')}"]
    steps = run["steps"]
    peak = max((r.get("mem_reserved_gib", r.get("mem_rss_peak_gib", 0)) for r in steps), default=0)
    allocated = max((r.get("mem_allocated_gib", 0) for r in steps), default=0)
    rel = [abs(a - b) / abs(b) for a, b in paired_losses(run, base)] if base else []
    liger = "Liger kernels" in run["started"]
    return [arm, repeat, f"{tokens_per_s(run, tokens_per_step, skip):,.0f}", f"{peak:.2f} / {allocated:.2f}",
            f"{steps[-1]['loss']:.4f}", f"{max(rel) * 100:.3f} %" if rel else "",
            "yes" if liger else "no", ""]


def main() -> int:
    a = arms_parser(__doc__, ARMS, 20, "liger").parse_args()
    if C.args_only():
        return 0
    setup, skip, tokens_per_step, runs = run_arms(a, ARMS, [])
    print(f"# Liger-Kernel vs shardtune's own path ({'rehearsal on CPU' if a.rehearse else 'GPU'})\n\n"
          f"{C.machine_line()}\n\nmodel {json.dumps(setup['model'])} | seq {setup['seq_len']} | micro "
          f"{setup['micro']} | global {setup['global']} | {setup['precision']} | {setup['steps']} steps (first "
          f"{skip} not timed) | python bench/liger_speed.py {' '.join(sys.argv[1:])}\n")
    rows = []
    for arm, results in runs.items():
        # losses against the same compile setting without Liger (compiled and eager differ by rounding)
        twin = "plain-compiled" if arm.endswith("compiled") else "plain"
        base = next((r for r in runs.get(twin, []) if "steps" in r), None) if arm.startswith("liger") else None
        rows += [row(arm, i, run, tokens_per_step, skip, base) for i, run in enumerate(results)]
    print(C.markdown_table(["arm", "repeat", "tok/s", "peak GiB reserved / allocated", "last loss",
                            "max relative Δloss vs its plain twin", "Liger applied", "note"], rows))
    speed = {arm: statistics.mean(tokens_per_s(r, tokens_per_step, skip) for r in results if "steps" in r)
             for arm, results in runs.items() if any("steps" in r for r in results)}
    for liger, plain in (("liger", "plain"), ("liger-compiled", "plain-compiled")):
        if liger in speed and plain in speed:
            print(f"\n- {liger}: {speed[liger] / speed[plain]:.3f}x the tokens/s of {plain}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
