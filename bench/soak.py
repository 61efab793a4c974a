"""Soak: one long training run, to show that host RSS, step time (and on CUDA the allocated /
reserved memory) stay flat after warm-up, with checkpoints, evaluation, logging and a tracker on.

`.venv/bin/python bench/soak.py --minutes 30` (CPU) or `--device cuda` (GPU suite). The run is a
quickstart-sized GPT-2 on the offline docstring corpus (many epochs in 30 minutes, so the data
path wraps around), started as a real `shardtune train` process. A short calibration run sizes
the checkpoint and evaluation cadences in steps (`--checkpoint-minutes`, `--eval-minutes`); at
the deadline the bench sends SIGTERM, so the run also ends through the preemption path (exit 75,
a final checkpoint). Meanwhile this process samples the RSS of the run's process tree every
`--sample-s` seconds and reads the new metrics.jsonl records; the table gives one row per
`--bucket-minutes`, and the verdict compares the end with the end of warm-up (`--warmup-minutes`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    MB,
    PYTHON,
    args_only,
    default_workdir,
    machine_line,
    markdown_table,
    overrides_from,
    quickstart_assets,
)

MODEL = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 256, "vocab_size": 2048}
# Flat means: RSS grows by at most this much from the end of warm-up to the end (and its fitted
# slope says the same), and the CPU time per step grows by at most this share (a leak or a
# growing log shows as growth; less work per step is no regression). Wall-clock step time is
# shown too, beside the load average: on a shared machine it follows the other load, and CPU
# time per step does a little too (cache and memory bandwidth are shared).
RSS_GROWTH_LIMIT_MB, STEP_TIME_CHANGE_LIMIT = 50.0, 0.15


def run_tree(args, out: Path, extra: dict) -> list[str]:
    assets = quickstart_assets(2048)
    tree = {"model": {"tokenizer": assets["tokenizer"], "config": MODEL},
            "data": {"path": str(Path(assets["train"]).parent), "seq_len": 128},
            "train": {"micro_batch_size": 16, "global_batch_size": 32, "lr": 1e-3, "warmup_steps": 20,
                      "weight_decay": 0.01},
            "eval": {"max_batches": 8}, "log": {"every_steps": args.log_every, "progress": False},
            "device": args.device, "output_dir": str(out), "on_nan": "skip"}
    return ["train", *overrides_from(tree), *overrides_from(extra), "--overwrite"]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def calibrate(args, workdir: Path) -> float:
    """Median seconds per optimizer step of this setup on this machine (a 60-step run)."""
    out = workdir / "calibrate"
    proc = subprocess.run([PYTHON, "-m", "shardtune", *run_tree(args, out, {
        "train": {"max_steps": 60}, "eval": {"at_start": False}, "log": {"every_steps": 10}})],
        capture_output=True, text=True, env=env(), timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"calibration run failed:\n{proc.stdout}\n{proc.stderr}")
    times = [r["step_time_s"] for r in records(out / "metrics.jsonl") if "step_time_s" in r][1:]
    return statistics.median(times)


def tree_usage(pid: int) -> tuple[int, float]:
    """(resident bytes, CPU seconds) of `pid` and all its descendants (Linux /proc)."""
    rss, cpu, todo = 0, 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/stat") as f:
                utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
            cpu += (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return rss, cpu


def soak(args, workdir: Path, step_s: float) -> tuple[list[dict], int, str]:
    """Run until the deadline; returns the samples ({t, rss, step}), the exit code and the output tail."""
    every = lambda minutes: max(1, round(minutes * 60 / step_s))  # noqa: E731
    steps = round(args.minutes * 60 / step_s * 10)  # far more than the deadline allows (load varies): SIGTERM ends it
    out = workdir / "soak"
    extra = {"train": {"max_steps": steps}, "eval": {"every_steps": every(args.eval_minutes)},
             "checkpoint": {"every_steps": every(args.checkpoint_minutes), "keep_last": 2,
                            "async": args.async_save},
             "log": {"trackers": args.trackers}}
    log = open(workdir / "soak.log", "w")
    proc = subprocess.Popen([PYTHON, "-m", "shardtune", *run_tree(args, out, extra)], stdout=log,
                            stderr=subprocess.STDOUT, env=env())
    print(f"soak: pid {proc.pid}, {steps} steps planned, checkpoint every {extra['checkpoint']['every_steps']}, "
          f"eval every {extra['eval']['every_steps']} steps; log {workdir / 'soak.log'}", flush=True)
    start, deadline, seen, samples = time.time(), time.time() + args.minutes * 60, 0, []
    while proc.poll() is None and time.time() < deadline:
        rows = records(out / "metrics.jsonl")
        new, seen = rows[seen:], len(rows)
        rss, cpu = tree_usage(proc.pid)
        step = max((r["step"] for r in rows), default=0)
        samples.append({"t": time.time() - start, "rss": rss, "cpu": cpu, "step": step, "load": os.getloadavg()[0],
                        "records": new})
        time.sleep(args.sample_s)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    log.close()
    tail = "\n".join((workdir / "soak.log").read_text().splitlines()[-5:])
    return samples, code, tail


def cpu_ms_per_step(group: list[dict]) -> float:
    """CPU time the run spent per optimizer step between the first and last sample of `group`:
    unlike wall-clock step time, it does not move when other work shares the machine."""
    steps = group[-1]["step"] - group[0]["step"]
    return (group[-1]["cpu"] - group[0]["cpu"]) * 1000 / steps if steps > 0 else float("nan")


def summarise(samples: list[dict], args) -> tuple[list[list], dict]:
    bucket_s = args.bucket_minutes * 60
    rows, buckets = [], {}
    for s in samples:
        buckets.setdefault(int(s["t"] // bucket_s), []).append(s)
    gib_keys = ("mem_allocated_gib", "mem_reserved_gib")
    for b, group in sorted(buckets.items()):
        recs = [r for s in group for r in s["records"] if "step_time_s" in r]
        step_ms = statistics.median(r["step_time_s"] for r in recs) * 1000 if recs else float("nan")
        row = [f"{b * args.bucket_minutes:g}-{(b + 1) * args.bucket_minutes:g}", group[-1]["step"],
               f"{statistics.median(s['rss'] for s in group) / MB:.0f}", f"{max(s['rss'] for s in group) / MB:.0f}",
               f"{step_ms:.1f}", f"{cpu_ms_per_step(group):.1f}", f"{statistics.mean(s['load'] for s in group):.1f}"]
        if args.device == "cuda":
            row += [f"{max((r.get(k, 0) for r in recs), default=0):.3f}" for k in gib_keys]
        rows.append(row)

    after = [s for s in samples if s["t"] >= args.warmup_minutes * 60]
    window = max(2, len(after) // 5)  # the first and last fifth after warm-up
    rss_start = statistics.median(s["rss"] for s in after[:window]) / MB
    rss_end = statistics.median(s["rss"] for s in after[-window:]) / MB
    ts, rss = [s["t"] for s in after], [s["rss"] / MB for s in after]
    slope = statistics.linear_regression(ts, rss).slope * 3600 if len(after) > 2 else 0.0
    cpu_start, cpu_end = cpu_ms_per_step(after[:window]), cpu_ms_per_step(after[-window:])
    verdict = {"rss_start_mb": rss_start, "rss_end_mb": rss_end, "rss_slope_mb_per_h": slope,
               "cpu_ms_start": cpu_start, "cpu_ms_end": cpu_end,
               "flat": (rss_end - rss_start <= RSS_GROWTH_LIMIT_MB and slope * args.minutes / 60 <= RSS_GROWTH_LIMIT_MB
                        and cpu_end / cpu_start - 1 <= STEP_TIME_CHANGE_LIMIT)}
    return rows, verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="length of the soak run (default 30)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--checkpoint-minutes", type=float, default=3.0, help="checkpoint cadence (default 3)")
    p.add_argument("--eval-minutes", type=float, default=1.0, help="evaluation cadence (default 1)")
    p.add_argument("--async-save", action="store_true", help="checkpoint.async=true")
    p.add_argument("--trackers", nargs="*", default=["tensorboard"], help="log.trackers (default tensorboard)")
    p.add_argument("--log-every", type=int, default=10, help="log.every_steps (default 10)")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling interval (default 5 s)")
    p.add_argument("--warmup-minutes", type=float, default=3.0, help="left out of the verdict (default 3)")
    p.add_argument("--bucket-minutes", type=float, default=3.0, help="table row length (default 3)")
    p.add_argument("--workdir", type=Path, default=default_workdir() / "soak")
    p.add_argument("--summarise", action="store_true", help="only print the table and verdict of the soak "
                   "already in --workdir (its samples.json)")
    args = p.parse_args()
    if args_only():
        return 0
    if args.summarise:
        samples = json.loads((args.workdir / "samples.json").read_text())
        return report(samples, None, "(not rerun)", args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda needs a CUDA GPU; run the CPU soak without it", file=sys.stderr)
            return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(machine_line(), flush=True)
    step_s = calibrate(args, args.workdir)
    print(f"calibration: {step_s * 1000:.1f} ms per step", flush=True)
    samples, code, tail = soak(args, args.workdir, step_s)
    (args.workdir / "samples.json").write_text(json.dumps(samples))
    return report(samples, code, tail, args)


def report(samples: list[dict], code: int | None, tail: str, args) -> int:
    rows, verdict = summarise(samples, args)
    headers = ["minutes", "last step", "RSS median MB", "RSS max MB", "step ms (wall, median)", "CPU ms per step",
               "load avg"]
    if args.device == "cuda":
        headers += ["allocated peak GiB", "reserved peak GiB"]
    print(markdown_table(headers, rows))
    print(f"\nexit code {code} (75 = stopped by the bench's SIGTERM after a checkpoint); last lines:\n{tail}")
    print(f"\nafter {args.warmup_minutes:g} min warm-up: RSS {verdict['rss_start_mb']:.0f} -> "
          f"{verdict['rss_end_mb']:.0f} MB (fitted slope {verdict['rss_slope_mb_per_h']:+.1f} MB/h), "
          f"CPU time per step {verdict['cpu_ms_start']:.1f} -> "
          f"{verdict['cpu_ms_end']:.1f} ms: {'flat' if verdict['flat'] else 'NOT flat'} "
          f"(limits: +{RSS_GROWTH_LIMIT_MB:.0f} MB, +{STEP_TIME_CHANGE_LIMIT:.0%} CPU time per step)")
    return 0 if verdict["flat"] and code in (75, None) else 1


if __name__ == "__main__":
    sys.exit(main())
