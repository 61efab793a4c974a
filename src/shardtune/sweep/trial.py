"""One trial of `shardtune sweep`: a real `shardtune train` process (N ranks with --nproc),
optionally under a memory cap, and what it left behind: its status (ok, out of memory, another
failure), the line that says why, and its speed, memory and validation numbers."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardtune.distributed.process_group import own_job_env
from shardtune.errors import UserError

POLL_S = 0.5  # how often a watched trial's metrics.jsonl is read
LIVE_STEPS = 2  # CPU trials count live tensor bytes over their first steps (the peak is in step 2)
# What a failed trial prints when it ran out of memory: CUDA's allocator, torch's CPU allocator
# (ENOMEM under the data-segment cap), Python, C++, and threads or libraries that could not be mapped.
OOM_SIGNS = ("out of memory", "outofmemoryerror", "memoryerror", "can't allocate memory", "cannot allocate memory",
             "bad_alloc", "can't start new thread", "failed to map segment")
# A capped CPU trial should run out of memory when its tensors (and the libraries) exceed the cap:
# pyarrow's mimalloc maps a 1 GiB arena at once when it can and smaller ones when it cannot (the cap
# would bind at random), and glibc keeps freed tensor buffers for reuse (the cap would bind on its
# cache, which grows with the small Python objects that live-memory tracking allocates between them).
CAPPED_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_MMAP_THRESHOLD_": "131072",
              "MALLOC_TRIM_THRESHOLD_": "131072"}


def run_trial(sweep, point: dict, name: str, cap: int | None, micro_batch: int | None = None,
              watch=None, checkpointing: str | None = None) -> dict:
    """One `shardtune train` process (N ranks with --nproc), its output in OUT/trials/NAME;
    `cap` bounds the data segment of each of its processes (CPU). `watch(folder)`, asked every
    POLL_S while the trial runs, may stop it early (returns True): its status is then "pruned"."""
    folder = sweep.out / "trials" / name
    # an earlier trial's files (an interrupted one rerun, another study's trial-0000) were read as
    # this one's: by `watch` (the pruner) before train replaced them, and as the record of a trial
    # that failed before it wrote any
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "shardtune", "train", *([sweep.recipe] if sweep.recipe else []),
            *sweep.trial_overrides(point, micro_batch, folder, checkpointing), "--overwrite",
            *(["--nproc", str(sweep.nproc)] if sweep.nproc > 1 else [])]
    env = own_job_env(os.environ)  # a trial is a job of its own, even where the sweep runs under srun
    if cap:
        env.update(CAPPED_ENV)
    start = time.perf_counter()
    with open(folder / "stdout.log", "w") as out, open(folder / "stderr.log", "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env,
                                preexec_fn=(lambda: _cap_data_segment(cap)) if cap else None)
        code, pruned = _wait(proc, folder, watch)
    record = {"name": name, "point": point, "micro_batch": micro_batch, "seconds": time.perf_counter() - start,
              "exit_code": code}
    stderr = (folder / "stderr.log").read_text(errors="replace")
    record.update(_measurements(folder, sweep))
    if pruned:
        record.update(status="pruned", note="stopped early by the pruner")
        return record
    if code == 0:
        record["status"] = "ok"
        over = sweep.device == "cuda" and sweep.mem_limit and \
            (record.get("mem_reserved_gib") or 0) * 2**30 > sweep.mem_limit
        if over:
            record.update(status="over_limit", note=f"reserved {record['mem_reserved_gib']:.3g} GiB > --mem-limit")
        return record
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL) or rank_killed(stderr):
        record.update(status="oom", note="killed by SIGKILL (the kernel's out-of-memory killer?)")
    else:
        record.update(status="oom" if any(s in stderr.lower() for s in OOM_SIGNS) else "failed",
                      note=failure_line(stderr) or f"exit code {code}")
    return record


def not_run(point: dict, name: str, why: str) -> dict:
    """The record of a trial refused before its process started (the planner found no layout of its
    point's `auto` values that fits): failed, saying why, like a trial that crashed."""
    return {"name": name, "point": point, "micro_batch": None, "seconds": 0.0, "exit_code": None, "status": "failed",
            "note": why}


def _wait(proc: subprocess.Popen, folder: Path, watch) -> tuple[int, bool]:
    """(exit code, whether `watch` stopped it). A stopped trial is killed: its ranks follow their
    launcher (rank.lifecycle.die_with_launcher), and a trial has nothing to save. A trial that ended before
    `watch` saw its last lines is judged on them too (as if it had been watched in time)."""
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S if watch else None)
                return code, bool(watch is not None and code == 0 and watch(folder))
            except subprocess.TimeoutExpired:
                if watch(folder):
                    proc.kill()
                    return proc.wait(), True
    except BaseException:  # an interrupt of the sweep ends its trial too
        proc.kill()
        proc.wait()
        raise


def _cap_data_segment(limit: int) -> None:
    """In the trial process before exec: RLIMIT_DATA bounds its heap and anonymous mappings
    (torch's CPU tensors), unlike RLIMIT_AS which also counts the libraries' code. Inherited
    by the ranks, so with --nproc every rank has the cap."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def rank_killed(stderr: str) -> bool:
    """Under --nproc: the launcher's line names a rank that SIGKILL ended (the launcher itself then
    exits 1, not -9): what the kernel's out-of-memory killer does to the rank over the memory."""
    from shardtune.launch.local import SUMMARY_END

    return any(line.startswith("error: ") and line.endswith(SUMMARY_END)
               and "(signal SIGKILL) failed" in line.partition(";")[0] for line in stderr.splitlines())


def failure_line(stderr: str) -> str:
    """The line that says what went wrong: the last exception or error line (the launcher's
    "rank N ... failed" summary is not it), without the `[rankN]:` prefix."""
    from shardtune.launch.local import SUMMARY_END

    lines = [re.sub(r"^\[(?:default)?rank\d+\]:\s*", "", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line and not (line.startswith("error: ") and line.endswith(SUMMARY_END))]
    errors = [line for line in lines if re.match(r"^([\w.]*(Error|Exception|Interrupt)\b|error:)", line)]
    return (errors or lines or [""])[-1][:300]


def _measurements(folder: Path, sweep) -> dict:
    """Speed, memory and validation numbers of a trial from its metrics.jsonl (what exists)."""
    from shardtune.telemetry.report import over_time, read_metrics, timed_windows

    try:
        rows = read_metrics(folder)
    except UserError:
        return {}
    steps = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    # speed from the steady steps: not the first (start-up) nor those slowed by live-memory tracking
    timed = timed_windows(rows, skip=LIVE_STEPS if sweep.device == "cpu" else 1)
    seconds, count = sum(w[2] for w in timed), sum(w[1] for w in timed)

    def peak(key):
        values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    out = {"tokens_per_s": over_time(timed, "tokens_per_s"), "step_time_s": seconds / count if count else None,
           "mfu": over_time(timed, "mfu"), "gpu_util": over_time(timed, "gpu_util"),
           "mem_allocated_gib": peak("mem_allocated_gib"),
           "mem_reserved_gib": peak("mem_reserved_gib"), "mem_live_gib": peak("mem_live_peak_gib"),
           "mem_rss_gib": peak("mem_rss_peak_gib")}
    evals = [r for r in rows if "eval_loss" in r and r.get("step") == sweep.eval_steps]
    if sweep.eval_steps and evals:
        out.update(eval_loss=evals[-1]["eval_loss"], eval_ppl=evals[-1]["eval_ppl"])
    return {k: v for k, v in out.items() if v is not None}
