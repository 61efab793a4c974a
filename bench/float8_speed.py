"""float8 against bf16 on one GPU: tokens/s, peak memory and the loss curve of the same fine-tune.

The Llama ~1B shape of `vs_hf_trainer.py --gpu` (seq 2048, random init, the quickstart corpus),
compiled in every arm (float8's casts need it), trained `--steps` optimizer steps in each arm:
bf16, float8=rowwise, float8=tensorwise, in that order `--repeats` times, so drift hits all arms.

    python bench/float8_speed.py                  # on a GPU of compute capability 8.9+ (H100)
    python bench/float8_speed.py --rehearse       # the same code path, tiny, on CPU: the bf16 arm
                                                  # trains, the float8 arms must be refused in one line
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_hf_trainer import resolve_setup, shardtune_overrides  # noqa: E402

import _common as C  # noqa: E402

ARMS = {"bf16": [], "rowwise": ["float8=rowwise"], "tensorwise": ["float8=tensorwise"]}


def train(out: Path, overrides: list[str]) -> dict:
    """One arm's run: its per-step records, or the one line it was refused with."""
    cmd = [C.PYTHON, "-m", "shardtune", "train", *overrides, "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.BENCH_DIR.parent)
    if proc.returncode == 2:  # bad input: shardtune's one line
        return {"refused": next((line.removeprefix("error: ") for line in proc.stderr.splitlines()
                                 if line.startswith("error:")),
                                C.last_error_line(proc))}
    if proc.returncode:
        return {"error": C.last_error_line(proc)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    started = next((line for line in proc.stdout.splitlines() if line.startswith("model:")), "")
    layers = started.split("float8 ")[1].split(" |")[0] if "float8 " in started else "none"
    return {"steps": [r for r in rows if r.get("loss") is not None and "step_time_s" in r], "float8_layers": layers,
            "started": started}


def predicted_gains(overrides: list[str]) -> dict[str, float]:
    """`shardtune plan`'s predicted tokens/s of each float8 recipe over bf16 for this fine-tune on
    this GPU (an H100 when there is none: the rehearsal), from the float8 lines of its answer."""
    import torch

    from shardtune.hardware import gpu_by_device_name

    known = gpu_by_device_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    cmd = [C.PYTHON, "-m", "shardtune", "plan", *overrides, "--gpus", "1", "--gpu", known.name if known else "H100",
           "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.BENCH_DIR.parent)
    if proc.returncode:
        return {}
    best = json.loads(proc.stdout)["best"] or {}
    return {alt["recipe"]: alt["tokens_per_s"] / best["tokens_per_s"] for alt in best.get("float8_alternatives", [])}


def paired_losses(run: dict, base: dict) -> list[tuple[float, float]]:
    """The two runs' losses at each step both trained (a step skipped as non-finite has none)."""
    theirs = {r["step"]: r["loss"] for r in base["steps"]}
    return [(r["loss"], theirs[r["step"]]) for r in run["steps"] if theirs.get(r["step"]) is not None]


def tokens_per_s(run: dict, tokens_per_step: int, skip: int) -> float:
    timed = [r["step_time_s"] for r in run["steps"][skip:]]
    return tokens_per_step * len(timed) / sum(timed)


def summary(run: dict, tokens_per_step: int, skip: int, base: dict | None) -> list:
    steps = run["steps"]
    peak = max((r.get("mem_reserved_gib", r.get("mem_rss_peak_gib", 0)) for r in steps), default=0)
    row = [run["float8_layers"], f"{tokens_per_s(run, tokens_per_step, skip):,.0f}", f"{peak:.2f}",
           f"{steps[-1]['loss']:.4f}"]
    if base is None:
        return row + ["", ""]
    rel = [abs(a - b) / abs(b) for a, b in paired_losses(run, base)]
    return row + [f"{statistics.mean(rel) * 100:.2f} %", f"{max(rel) * 100:.2f} %"]


def arms_parser(doc: str, arms: dict, steps: int, workdir: str) -> argparse.ArgumentParser:
    """The options of a bench (its docstring `doc`) that trains `arms` (name -> overrides) of the
    same Llama ~1B run."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps per run (default {steps})")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of tokens/s (compilation, warm-up)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (default 8)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the arms (default 1)")
    p.add_argument("--arms", nargs="+", choices=sorted(arms), default=list(arms))
    p.add_argument("--rehearse", action="store_true", help="tiny, on CPU: checks the plumbing without a GPU")
    p.add_argument("--workdir", type=Path, default=C.default_workdir() / workdir)
    return p


def run_arms(a, arms: dict, common: list[str], setup_name: str = "gpu") -> tuple[dict, int, int, dict[str, list[dict]]]:
    """Each arm in order, `a.repeats` rounds (drift hits all), on vs_hf_trainer's setup
    `setup_name`: (setup, steps not timed, tokens per step, the runs of each arm)."""
    setup = resolve_setup(setup_name, a.steps, a.global_batch, a.rehearse)
    skip = min(a.skip, setup["steps"] - 2) if a.rehearse else a.skip
    assets = C.quickstart_assets()
    runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    for repeat in range(a.repeats):
        for arm in a.arms:
            out = a.workdir / f"{arm}-{repeat}"
            base = shardtune_overrides(setup, assets["tokenizer"], str(Path(assets["train"]).parent), out, 1,
                                       "full_shard")
            # on_nan=skip: the random-init 1B's NaN gradient at step 13 (global 8) must not end a speed arm
            runs[arm].append(train(out, [*base, *common, "save_final=false", "on_nan=skip", *arms[arm]]))
    return setup, skip, setup["global"] * setup["seq_len"], runs


def main() -> int:
    a = arms_parser(__doc__, ARMS, 50, "float8").parse_args()
    if C.args_only():
        return 0
    setup, skip, tokens_per_step, runs = run_arms(a, ARMS, ["compile=true"])
    print(f"# float8 vs bf16 ({'rehearsal on CPU' if a.rehearse else 'GPU'})\n\n{C.machine_line()}\n\n"
          f"model {json.dumps(setup['model'])} | seq {setup['seq_len']} | micro {setup['micro']} | global "
          f"{setup['global']} | {setup['steps']} steps (first {skip} not timed) | compile=true | "
          f"python bench/float8_speed.py {' '.join(sys.argv[1:])}\n")
    first_bf16 = next((r for r in runs.get("bf16", []) if "steps" in r), None)
    rows = []
    for arm, results in runs.items():
        for repeat, run in enumerate(results):
            if "steps" not in run:
                rows.append([arm, repeat, "", "", "", "", "", "", f"{'refused' if 'refused' in run else 'error'}: "
                             f"{run.get('refused') or run.get('error')}"])
                continue
            rows.append([arm, repeat, *summary(run, tokens_per_step, skip, None if arm == "bf16" else first_bf16), ""])
    print(C.markdown_table(["arm", "repeat", "float8 layers", "tok/s", "peak GiB", "last loss", "mean |Δloss|",
                            "max |Δloss|", "note"], rows))
    # the planner's prediction for the same fine-tune, against the measurement (plan/cost.FLOAT8_EFFICIENCY)
    assets = C.quickstart_assets()
    predicted = predicted_gains([*shardtune_overrides(setup, assets["tokenizer"], str(Path(assets["train"]).parent),
                                                      a.workdir / "plan", 1, "full_shard"), "compile=true"])
    speed = {arm: statistics.mean(tokens_per_s(r, tokens_per_step, skip) for r in results if "steps" in r)
             for arm, results in runs.items() if any("steps" in r for r in results)}
    lines = [f"- {recipe}: predicted {predicted.get(recipe, float('nan')):.3f}x bf16, measured "
             + (f"{speed[recipe] / speed['bf16']:.3f}x" if recipe in speed and "bf16" in speed else "-")
             for recipe in ("rowwise", "tensorwise") if recipe in runs]
    print("\nthe planner against the measurement (tokens/s over bf16; its float8 lines for this model):\n"
          + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
