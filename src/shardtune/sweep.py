"""`shardtune sweep`: a grid of short real `train` runs (sharding, wrapping, prefetch, precision,
activation checkpointing, ...), each in its own process, with the recipe's global batch kept;
optionally the largest micro-batch per rank that fits; a csv, a markdown table and plots.

Every trial is exactly what a user would run (`python -m shardtune train RECIPE ...`); its record
comes from its metrics.jsonl and exit status, so a crash or an out-of-memory in one trial is data,
not the end of the sweep. The state is kept in OUT/sweep.json, rewritten after every trial, so a
rerun of the same command continues where an interrupted one stopped.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .errors import UserError

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
TRIAL_SETTINGS = ["save_final=false", "checkpoint.every_steps=0", "checkpoint.at_epoch_end=false", "resume=null",
                  "log.every_steps=1", "log.progress=false", "log.trackers=[]"]
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
              "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


@dataclasses.dataclass
class Sweep:
    """What the command asked for; its `spec()` must match for a rerun to continue a sweep."""
    recipe: str | None
    overrides: list[str]
    grid: list[tuple[str, list[str]]]
    steps: int = 5
    eval_steps: int | None = None
    max_batch: bool = False
    nproc: int = 1
    mem_limit: int | None = None  # bytes: the cap on a CPU trial's data segment, the budget on a GPU
    out: Path = Path("runs/sweep")
    defaults: dict | None = None  # the quickstart's settings when there is no recipe
    device: str = "cpu"  # where the trials run: "cpu" or "cuda"

    def spec(self) -> dict:
        return {"recipe": self.recipe, "overrides": self.overrides, "grid": [[k, v] for k, v in self.grid],
                "steps": self.steps, "eval_steps": self.eval_steps, "max_batch": self.max_batch,
                "nproc": self.nproc, "mem_limit": self.mem_limit}

    def points(self) -> list[dict[str, str]]:
        keys = [k for k, _ in self.grid]
        return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in self.grid))]

    def trial_overrides(self, point: dict, micro_batch: int | None) -> list[str]:
        """The overrides of one trial, in the order they win: the user's, the grid point's, the sweep's."""
        words = [*self.overrides, *(f"{k}={v}" for k, v in point.items()), *TRIAL_SETTINGS,
                 f"train.max_steps={max(self.steps, self.eval_steps or 0)}", "eval.at_start=false"]
        if micro_batch is not None:
            words.append(f"train.micro_batch_size={micro_batch}")
        # without --eval-steps only the end-of-run evaluation is left: one batch, not the whole split
        words += [f"eval.every_steps={self.eval_steps}"] if self.eval_steps else ["eval.every_steps=0",
                                                                                  "eval.max_batches=1"]
        if self.device == "cpu":
            words.append(f"log.live_memory={LIVE_STEPS}")
        return words

    def config(self, point: dict, micro_batch: int | None = None):
        from .config import load_config

        return load_config(self.recipe, self.trial_overrides(point, micro_batch), self.defaults)


# ----------------------------------------------------------------------------- input


def split_values(text: str) -> list[str]:
    """`a,b,[0.9,0.95]` -> ["a", "b", "[0.9,0.95]"]: commas inside brackets, braces or quotes stay."""
    values, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(current.strip())
            current = ""
            continue
        current += ch
    values.append(current.strip())
    return values


def parse_grid(texts: list[str]) -> list[tuple[str, list[str]]]:
    grid = []
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        values = split_values(raw) if raw.strip() else []
        if not sep or not key or not values or "" in values:
            raise UserError(f"--grid {text!r} is not KEY=V1,V2,...; write it like --grid fsdp.sharding=full_shard,no_shard")
        if key in ("output_dir", "resume"):
            raise UserError(f"--grid {key} is set by the sweep for each trial; sweep other keys")
        if key in dict(grid):
            raise UserError(f"--grid {key} is given twice; list all its values in one --grid {key}=V1,V2,...")
        if len(set(values)) < len(values):
            raise UserError(f"--grid {key} repeats a value ({raw}); list each value once")
        grid.append((key, values))
    return grid


def parse_size(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5G`, `4e9` -> bytes (G/M/K without `i` are powers of 10)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in SIZE_UNITS:
        raise UserError(f"--mem-limit {text!r} is not a size; write it like 2GiB, 512MiB or 8GB")
    size = int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
    if size <= 0:
        raise UserError(f"--mem-limit must be positive, got {text!r}")
    return size


def check(sweep: Sweep) -> None:
    """Everything that can be refused before a trial starts: every grid point must load as a
    valid config whose batch sizes divide over the ranks."""
    from .config import check_world

    if sweep.steps < 1:
        raise UserError(f"--steps must be at least 1, got {sweep.steps}")
    if sweep.eval_steps is not None and sweep.eval_steps < 1:
        raise UserError(f"--eval-steps must be at least 1, got {sweep.eval_steps}")
    if sweep.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {sweep.nproc}")
    if not sweep.grid and not sweep.max_batch:
        raise UserError("nothing to sweep; give --grid KEY=V1,V2,... (and/or --max-batch)")
    for word in sweep.overrides:
        if word.partition("=")[0].strip() in ("output_dir", "resume"):
            raise UserError(f"{word!r}: the sweep sets output_dir and resume for each trial; use --out for the sweep")
    if sweep.max_batch and "train.micro_batch_size" in dict(sweep.grid):
        raise UserError("--max-batch searches train.micro_batch_size itself; drop it from --grid")
    sweep.config({})  # the recipe and overrides alone: their errors are not the grid's
    for point in sweep.points():
        where = " ".join(f"{k}={v}" for k, v in point.items())
        try:
            cfg = sweep.config(point)
            if sweep.max_batch:
                if not micro_batch_candidates(cfg, sweep.nproc):
                    raise UserError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
                                    f"--nproc {sweep.nproc}; change one of them")
            else:
                check_world(cfg, sweep.nproc)
        except UserError as exc:
            raise UserError(f"--grid {where}: {exc}") from None


def micro_batch_candidates(cfg, nproc: int) -> list[int]:
    """Micro-batches that keep the global batch: the divisors of global batch / ranks."""
    per_rank, rest = divmod(cfg.train.global_batch_size, nproc)
    return [] if rest else [m for m in range(1, per_rank + 1) if per_rank % m == 0]


# ----------------------------------------------------------------------------- max batch


def search_max_batch(candidates: list[int], seed: int, attempt) -> tuple[int | None, str]:
    """Largest candidate for which `attempt(mb)` says "fits", probing few: the seed (an index),
    then one step up or down, doubling the step while every answer agrees, then bisecting between
    the largest fit and the smallest misfit. "broken" (a crash that is not memory) ends the search.
    Returns (largest fitting micro-batch or None, why the search stopped)."""
    lo, hi = -1, len(candidates)  # largest index known to fit, smallest known not to
    index, stride = seed, 1
    while True:
        verdict = attempt(candidates[index])
        if verdict == "broken":
            return (candidates[lo] if lo >= 0 else None), "broken"
        if verdict == "fits":
            lo = index
        else:
            hi = index
        if hi - lo <= 1:
            break
        if hi == len(candidates):  # nothing has failed yet: climb
            index, stride = min(lo + stride, hi - 1), stride * 2
        elif lo < 0:  # nothing has fitted yet: descend
            index, stride = max(hi - stride, 0), stride * 2
        else:
            index = (lo + hi) // 2
    if lo < 0:
        return None, "none fits"
    return candidates[lo], "all fit" if lo == len(candidates) - 1 else "boundary"


def seed_index(candidates: list[int], start: int, limit: int | None, predict=None) -> int:
    """Where the search starts: the largest micro-batch whose predicted peak fits the limit,
    or without a prediction the recipe's own micro-batch."""
    if predict is not None and limit is not None:
        fitting = [i for i, mb in enumerate(candidates) if predict(mb) <= limit]
        return fitting[-1] if fitting else 0
    below = [i for i, mb in enumerate(candidates) if mb <= start]
    return below[-1] if below else 0


# ----------------------------------------------------------------------------- trials


def slug(point: dict) -> str:
    text = "_".join(f"{k}-{v}" for k, v in point.items()) or "recipe"
    return re.sub(r"[^A-Za-z0-9_.-]+", "", text.replace("=", "-").replace(",", "-"))[:150]


def run_trial(sweep: Sweep, point: dict, micro_batch: int | None, name: str, cap: int | None) -> dict:
    """One `shardtune train` process (N ranks with --nproc), its output in OUT/trials/NAME;
    `cap` bounds the data segment of each of its processes (CPU)."""
    folder = sweep.out / "trials" / name
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "shardtune", "train", *([sweep.recipe] if sweep.recipe else []),
            *sweep.trial_overrides(point, micro_batch), f"output_dir={folder}", "--overwrite",
            *(["--nproc", str(sweep.nproc)] if sweep.nproc > 1 else [])]
    env = dict(os.environ)
    if cap:
        env.update(CAPPED_ENV)
    start = time.perf_counter()
    with open(folder / "stdout.log", "w") as out, open(folder / "stderr.log", "w") as err:
        code = subprocess.run(argv, stdout=out, stderr=err, env=env,
                              preexec_fn=(lambda: _cap_data_segment(cap)) if cap else None).returncode
    record = {"name": name, "point": point, "micro_batch": micro_batch, "seconds": time.perf_counter() - start,
              "exit_code": code}
    stderr = (folder / "stderr.log").read_text(errors="replace")
    record.update(_measurements(folder, sweep))
    if code == 0:
        record["status"] = "ok"
        over = sweep.device == "cuda" and sweep.mem_limit and \
            (record.get("mem_reserved_gib") or 0) * 2**30 > sweep.mem_limit
        if over:
            record.update(status="over_limit", note=f"reserved {record['mem_reserved_gib']:.3g} GiB > --mem-limit")
        return record
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        record.update(status="oom", note="killed by SIGKILL (the kernel's out-of-memory killer?)")
    else:
        record.update(status="oom" if any(s in stderr.lower() for s in OOM_SIGNS) else "failed",
                      note=failure_line(stderr) or f"exit code {code}")
    return record


def _cap_data_segment(limit: int) -> None:
    """In the trial process before exec: RLIMIT_DATA bounds its heap and anonymous mappings
    (torch's CPU tensors), unlike RLIMIT_AS which also counts the libraries' code. Inherited
    by the ranks, so with --nproc every rank has the cap."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def failure_line(stderr: str) -> str:
    """The line that says what went wrong: the last exception or error line (the launcher's
    "N worker(s) failed" summary is not it), without the `[rankN]:` prefix."""
    lines = [re.sub(r"^\[(?:default)?rank\d+\]:\s*", "", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line and not (line.startswith("error: ") and "worker(s) failed" in line)]
    errors = [line for line in lines if re.match(r"^([\w.]*(Error|Exception|Interrupt)\b|error:)", line)]
    return (errors or lines or [""])[-1][:300]


def _measurements(folder: Path, sweep: Sweep) -> dict:
    """Speed, memory and validation numbers of a trial from its metrics.jsonl (what exists)."""
    from .report import read_metrics

    try:
        rows = read_metrics(folder)
    except UserError:
        return {}
    steps = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    # speed from the steady steps: not the first (start-up) nor those slowed by live-memory tracking
    skip = LIVE_STEPS if sweep.device == "cpu" else 1
    timed = steps[skip:] or steps[1:] or steps

    def mean(key):
        values = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    def peak(key):
        values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    out = {"tokens_per_s": mean("tokens_per_s"), "step_time_s": mean("step_time_s"), "mfu": mean("mfu"),
           "gpu_util": mean("gpu_util"), "mem_allocated_gib": peak("mem_allocated_gib"),
           "mem_reserved_gib": peak("mem_reserved_gib"), "mem_live_gib": peak("mem_live_peak_gib"),
           "mem_rss_gib": peak("mem_rss_peak_gib")}
    evals = [r for r in rows if "eval_loss" in r and r.get("step") == sweep.eval_steps]
    if sweep.eval_steps and evals:
        out.update(eval_loss=evals[-1]["eval_loss"], eval_ppl=evals[-1]["eval_ppl"])
    return {k: v for k, v in out.items() if v is not None}


# ----------------------------------------------------------------------------- the sweep


class State:
    """OUT/sweep.json: the sweep's spec and every finished trial, replaced atomically after each."""

    def __init__(self, sweep: Sweep):
        self.path = sweep.out / "sweep.json"
        self.spec = sweep.spec()
        self.trials: dict[str, dict] = {}
        if self.path.is_file():
            saved = json.loads(self.path.read_text())
            changed = [k for k in self.spec if saved["spec"].get(k) != self.spec[k]]
            if changed:
                raise UserError(f"{str(sweep.out)!r} holds a sweep with another {', '.join(changed)}; rerun that "
                                "sweep's own command to continue it, or give this one another --out")
            self.trials = saved["trials"]

    def add(self, record: dict) -> None:
        self.trials[record["name"]] = record
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"spec": self.spec, "trials": self.trials}, indent=1))
        os.replace(tmp, self.path)


def run_sweep(sweep: Sweep) -> Path:
    """Validate everything, then run (or take from OUT/sweep.json) each trial; write the outputs."""
    from .sweep_report import summarize_point, write_outputs

    from .launch import check_nproc, resolve_device

    check(sweep)
    device = sweep.config({}).device
    check_nproc(sweep.nproc, device)
    sweep.device = resolve_device(device).type
    if sweep.out.exists() and not sweep.out.is_dir():
        raise UserError(f"--out {str(sweep.out)!r} is a file; choose a folder")
    sweep.out.mkdir(parents=True, exist_ok=True)
    state = State(sweep)
    limit = memory_limit(sweep)
    points = sweep.points()
    done_before = len(state.trials)
    print(f"sweep: {len(points)} grid point(s){', max-batch search' if sweep.max_batch else ''} on "
          f"{sweep.nproc} {sweep.device} rank(s), {sweep.steps} steps each -> {sweep.out}"
          + (f" ({done_before} trial(s) already done)" if done_before else ""), flush=True)
    summaries = []

    def trial(point: dict, micro_batch: int | None) -> dict:
        name = slug(point) + (f"-mb{micro_batch}" if micro_batch is not None else "")
        if name not in state.trials:
            record = run_trial(sweep, point, micro_batch, name, limit if sweep.device == "cpu" else None)
            cfg = sweep.config(point, micro_batch)
            record["micro_batch"] = cfg.train.micro_batch_size
            record["accumulation"] = cfg.train.global_batch_size // (cfg.train.micro_batch_size * sweep.nproc)
            state.add(record)
            print(f"  {_describe(record)}", flush=True)
        return state.trials[name]

    try:
        for point in points:
            if not sweep.max_batch:
                summaries.append(summarize_point(point, [trial(point, None)], None, ""))
                continue
            cfg = sweep.config(point)
            candidates = micro_batch_candidates(cfg, sweep.nproc)
            records = []

            def attempt(micro_batch: int) -> str:
                records.append(trial(point, micro_batch))
                return {"ok": "fits", "oom": "too_big", "over_limit": "too_big"}.get(records[-1]["status"], "broken")

            best, why = search_max_batch(candidates, seed_index(candidates, cfg.train.micro_batch_size, limit),
                                         attempt)
            summaries.append(summarize_point(point, records, best, why))
    finally:  # also after an interrupt: what is done is written
        write_outputs(sweep, list(state.trials.values()), summaries, limit)
    return sweep.out / "sweep.md"


def memory_limit(sweep: Sweep) -> int | None:
    """Bytes per rank: --mem-limit, else the GPU's memory; on CPU without --mem-limit, the
    machine's memory over the ranks (the cap that keeps a max-batch search from swapping)."""
    if sweep.mem_limit:
        return sweep.mem_limit
    if sweep.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    if sweep.max_batch:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // sweep.nproc
    return None


def _describe(record: dict) -> str:
    text = f"{record['name']}: {record['status']}"
    if record["status"] == "ok":
        text += f", {record.get('tokens_per_s', 0):,.0f} tokens/s"
    else:
        text += f" ({record.get('note', '')})"
    return text + f" [{record['seconds']:.1f} s]"
