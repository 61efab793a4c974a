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
from pathlib import Path
from typing import NamedTuple

from shardtune.errors import UserError
from shardtune.fsio import json_loads, make_dir, refuse_foreign, write_text_atomic
from shardtune.hardware import GIB
from shardtune.sweep.max_batch import Predictions, max_batch_of, memory_limit, micro_batch_candidates, one_trial_of
from shardtune.sweep.report import describe, slug, write_outputs
from shardtune.sweep.trial import LIVE_STEPS, run_trial

SWEEP_FILES = ("sweep.json", "sweep.csv", "sweep.md", "trials")  # with the plots: what a sweep folder holds
KEEPS_NOTHING = "the sweep (a trial keeps and publishes nothing)"
MEASURES = "the sweep (it measures every step of a short run)"
TRIAL_SETTINGS = {**dict.fromkeys(["save_final=false", "checkpoint.every_steps=0", "checkpoint.at_epoch_end=false",
                                   "resume=null", "log.trackers=[]", "log.watch=none", "publish.hub_repo=null",
                                   "publish.wandb_artifacts=none"], KEEPS_NOTHING),
                  **dict.fromkeys(["log.every_steps=1", "log.progress=false", "eval.at_start=false"], MEASURES)}


# Below this a CPU trial cannot start: --mem-limit caps its whole process, and Python with torch's
# CPU build and the libraries holds about 0.35 GB before any tensor (README "Sweeps"). Under it
# every trial died at start (1B: "exit code -11") and the sweep recorded them as its answer.
MIN_CPU_MEM_LIMIT = 256 * 2 ** 20


class Setting(NamedTuple):
    """One key=value the sweep puts on a trial's command line after the user's overrides and the point."""
    word: str
    by: str  # what sets it, as a refusal names it: an option, or why the sweep fixes it
    fixed: bool = True  # the same in every trial: an override of that very value changes nothing


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
    mem_limit: int | None = None  # bytes per rank: the cap on a CPU trial's data segment, the budget on a GPU
    out: Path = Path("runs/sweep")
    defaults: dict | None = None  # the quickstart's settings when there is no recipe
    device: str = "cpu"  # where the trials run: "cpu" or "cuda"

    def spec(self) -> dict:
        """After `set_device`. With the base config as loaded and the device: a recipe edited (or the same
        path from another folder, or device=auto on another node) continued the sweep, mixing two runs."""
        base = self.config({}).to_dict()
        base.pop("output_dir")  # the --out folder as typed: the folder itself is what matters
        return {"recipe": self.recipe, "overrides": self.overrides, "grid": [[k, v] for k, v in self.grid],
                "steps": self.steps, "eval_steps": self.eval_steps, "max_batch": self.max_batch,
                "nproc": self.nproc, "mem_limit": self.mem_limit, "device": self.device,
                "config": json_loads(json.dumps(base, default=str))}  # as read back from sweep.json

    def points(self) -> list[dict[str, str]]:
        keys = [k for k, _ in self.grid]
        return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in self.grid))]

    def settings(self, micro_batch: int | None = None, folder: Path | None = None,
                 checkpointing: str | None = None) -> list[Setting]:
        """What the sweep sets on a trial's command line (the one list the trials and the checks of
        overrides and swept keys read): `folder` is the trial's output_dir (default: a stand-in);
        `checkpointing` the mode the sweep resolved for activation_checkpointing=auto."""
        words = [Setting(w, by) for w, by in TRIAL_SETTINGS.items()]
        words.append(Setting(f"train.max_steps={max(self.steps, self.eval_steps or 0)}", "--steps"))
        if micro_batch is not None:
            by = "--max-batch (it searches it)" if self.max_batch else "train.micro_batch_size=auto (per point)"
            words.append(Setting(f"train.micro_batch_size={micro_batch}", by, fixed=False))
        if checkpointing is not None:
            words.append(Setting(f"activation_checkpointing={checkpointing}",
                                 "activation_checkpointing=auto (per point)", fixed=False))
        if self.eval_steps:
            words.append(Setting(f"eval.every_steps={self.eval_steps}", "--eval-steps"))
        else:  # only the end-of-run evaluation is left: one batch, not the whole split
            words += [Setting("eval.every_steps=0", "--eval-steps (without it, no evaluation during a trial)"),
                      Setting("eval.max_batches=1", "the sweep without --eval-steps (one batch at a trial's end)")]
        if self.device == "cpu":
            words.append(Setting(f"log.live_memory={LIVE_STEPS}", "the sweep (it counts a CPU trial's live tensors)"))
        from shardtune.config.load import override_word

        words.append(Setting(override_word("output_dir", str(folder or self.out / "trials")),
                             "--out (a folder per trial under it)", fixed=False))
        return words

    def trial_overrides(self, point: dict, micro_batch: int | None, folder: Path | None = None,
                        checkpointing: str | None = None) -> list[str]:
        """The overrides of one trial, in the order they win: the user's, the grid point's, the sweep's."""
        return [*self.overrides, *(f"{k}={v}" for k, v in point.items()),
                *(s.word for s in self.settings(micro_batch, folder, checkpointing))]

    def config(self, point: dict, micro_batch: int | None = None, checkpointing: str | None = None):
        from shardtune.config.load import load_config

        return load_config(self.recipe, self.trial_overrides(point, micro_batch, checkpointing=checkpointing),
                           self.defaults)


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
            raise UserError(f"--grid {text!r} is not KEY=V1,V2,...; write it like "
                            "--grid fsdp.sharding=full_shard,no_shard")
        if key in dict(grid):
            raise UserError(f"--grid {key} is given twice; list all its values in one --grid {key}=V1,V2,...")
        if len(set(values)) < len(values):
            raise UserError(f"--grid {key} repeats a value ({raw}); list each value once")
        grid.append((key, values))
    return grid


def check(sweep: Sweep) -> None:
    """Everything that can be refused before a trial starts: every grid point must load as a
    valid config whose batch sizes divide over the ranks, and run on this machine."""
    if sweep.steps < 1:
        raise UserError(f"--steps must be at least 1, got {sweep.steps}")
    if sweep.eval_steps is not None and sweep.eval_steps < 1:
        raise UserError(f"--eval-steps must be at least 1, got {sweep.eval_steps}")
    if sweep.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {sweep.nproc}")
    if not sweep.grid and not sweep.max_batch:
        raise UserError("nothing to sweep; give --grid KEY=V1,V2,... (and/or --max-batch)")
    if sweep.max_batch and sweep.config({}).train.micro_batch_size == "auto":
        raise UserError("--max-batch searches train.micro_batch_size itself (with real trials); drop "
                        "train.micro_batch_size=auto, or drop --max-batch to use the planner's choice")
    set_device(sweep)
    check_mem_limit(sweep)
    check_overrides(sweep, [k for k, _ in sweep.grid], "--grid")
    sweep.config({})  # the recipe and overrides alone: their errors are not the grid's
    runs: dict[str, str] = {}  # each point's config -> the point: two that resolve the same are one run twice
    for point in sweep.points():
        where = " ".join(f"{k}={v}" for k, v in point.items())
        try:
            cfg = sweep.config(point)
            if (same := runs.setdefault(run_key(cfg), where)) != where:
                raise UserError(f"it is the same run as --grid {same} (the values mean the same); list each "
                                "value once")
            check_trial(sweep, cfg)
        except UserError as exc:
            if not point:  # --max-batch alone: the recipe's own line, as train's
                raise
            raise UserError(f"--grid {where}: {exc}") from None
    check_models(sweep, sweep.points(), "--grid")


def run_key(cfg) -> str:
    """A trial's config as its train resolves it (compile=auto,false on CPU, or device=auto,cpu, are one run)."""
    from shardtune.resolve.run import resolve_machine

    return json.dumps(dataclasses.asdict(resolve_machine(cfg)), sort_keys=True, default=str)


def check_trial(sweep: Sweep, cfg) -> None:
    """What one trial's config must pass here, before any trial runs (the grid's points and the
    search's values alike): its batch divides over the ranks, and this machine can run it."""
    from shardtune.config.load import auto_micro_batches, check_world

    if cfg.train.micro_batch_size == "auto":
        auto_micro_batches(cfg.train.global_batch_size, sweep.nproc)
    elif sweep.max_batch:
        if cfg.activation_checkpointing == "auto":  # its trials' memory follows the mode auto picks per size
            raise UserError("--max-batch searches the micro-batch of one layout; set activation_checkpointing "
                            "to a mode, or drop --max-batch to let train.micro_batch_size=auto choose both")
        if not micro_batch_candidates(cfg, sweep.nproc):
            raise UserError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
                            f"--nproc {sweep.nproc}; change one of them")
    else:
        check_world(cfg, sweep.nproc)
    machine_checks(cfg, sweep.device)


def check_mem_limit(sweep: Sweep) -> None:
    """A CPU cap that cannot hold a trial's interpreter and libraries (after `set_device`)."""
    if sweep.device == "cpu" and sweep.mem_limit is not None and sweep.mem_limit < MIN_CPU_MEM_LIMIT:
        raise UserError(f"--mem-limit of {sweep.mem_limit} bytes cannot hold a CPU trial: it caps the whole process, "
                        "whose Python and libraries take about 0.35 GB before any tensor; give --mem-limit 1GiB "
                        "or more")


def check_overrides(sweep: Sweep, swept: list[str], option: str) -> None:
    """What the trials' own settings (`Sweep.settings`) or the swept keys would replace is refused:
    an override (a value the user would not get; the recipe's values are the base the sweep
    changes), and a swept key (all its points one run)."""
    from shardtune.config.load import parse_override

    def hit(key: str, settings: list[Setting]) -> tuple[str, Setting] | None:  # the key, or one above it, set
        return next(((k, s) for s in settings if key == (k := s.word.partition("=")[0]) or key.startswith(k + ".")),
                    None)

    # an override's micro-batch is where --max-batch's search starts, as the recipe's is: not replaced
    axes = [Setting(f"{k}=", option, fixed=False) for k in swept]
    for word in sweep.overrides:
        key, value = parse_override(word)
        if not (found := hit(key, sweep.settings() + axes)):
            continue
        set_key, setting = found
        if setting.fixed and key == set_key and _plain(parse_override(setting.word)[1]) == _plain(value):
            continue  # the value the sweep sets anyway
        raise UserError(f"{word} is set per trial by {setting.by}; drop the override"
                        + (f" or the {option} axis {set_key}" if setting in axes else ""))
    own = sweep.settings(1 if sweep.max_batch else None)
    for key in swept:
        if found := hit(key, own):
            raise UserError(f"{option} {key} is set per trial by {found[1].by}; sweep other keys")


def _plain(value):
    return getattr(value, "parsed", value)  # a list or mapping override: what YAML read, not its text


def check_models(sweep: Sweep, points: list[dict], option: str) -> None:
    """`train`'s check of the model's config and tokenizer (`check.run.check_model`), on the
    recipe and overrides (the same line as train's) and on every point (the point named), before
    the first trial; the model config and tokenizer are loaded once per distinct model. A point
    whose model transformers cannot build is left to its trial, which records the crash."""
    from shardtune.check.run import check_model, local_tokenizer
    from shardtune.model.hf import load_hf_config

    loaded: dict[str, tuple | None] = {}
    for point in [{}, *points]:
        cfg = sweep.config(point)
        key = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str)
        try:
            if key not in loaded:
                try:
                    loaded[key] = (load_hf_config(cfg.model), local_tokenizer(cfg.model))
                except UserError:
                    if not point:
                        raise
                    loaded[key] = None
            if loaded[key] is not None:
                check_model(cfg, *loaded[key])
        except UserError as exc:
            if not point:
                raise
            raise UserError(f"{option} {' '.join(f'{k}={v}' for k, v in point.items())}: {exc}") from None


def machine_checks(cfg, device_type: str) -> None:
    """What `train` refuses on this machine before it builds anything (QLoRA, float8, kernels=liger
    need CUDA, float8 a recent GPU, kernels=liger Liger-Kernel): refused here, before the first
    trial, instead of once per trial."""
    if cfg.float8 == "none" and cfg.peft.quantize == "none" and cfg.kernels == "none":
        return  # no torch import: a bad grid is refused before anything loads
    import torch

    from shardtune.model.build import check_machine

    check_machine(cfg, torch.device(device_type))


# ----------------------------------------------------------------------------- the sweep


class State:
    """OUT/sweep.json: the sweep's spec and every finished trial, replaced atomically after each."""

    def __init__(self, sweep: Sweep):
        self.path = sweep.out / "sweep.json"
        self.spec = sweep.spec()
        self.trials: dict[str, dict] = {}
        if self.path.exists():
            saved = read_state(self.path)
            changed = [k for k in self.spec if saved["spec"].get(k) != self.spec[k]]
            if changed:
                raise UserError(f"{str(sweep.out)!r} holds a sweep with another {', '.join(changed)}; rerun that "
                                "sweep's own command to continue it, or give this one another --out")
            self.trials = saved["trials"]

    def add(self, record: dict) -> None:
        self.trials[record["name"]] = record
        write_text_atomic(self.path, json.dumps({"spec": self.spec, "trials": self.trials}, indent=1))


# What every finished trial's record holds (sweep/trial.py), with the types the report reads.
RECORD_TYPES = {"name": str, "point": dict, "status": str, "seconds": (int, float)}
NUMBER_FIELDS = ("micro_batch", "accumulation", "tokens_per_s", "step_time_s", "mfu", "mem_allocated_gib",
                 "mem_reserved_gib", "mem_live_gib", "mem_rss_gib", "gpu_util", "predicted_gib", "eval_loss",
                 "eval_ppl")


def read_state(path: Path) -> dict:
    """OUT/sweep.json as written by State.add, or one line saying it is damaged or not a sweep's."""
    fix = "move it away (or give another --out) and run again"
    try:
        saved = json_loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{str(path)!r} cannot be read as a sweep's state ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:100] if str(exc) else ''}); {fix}") from None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), dict) for k in ("spec", "trials")):
        raise UserError(f"{str(path)!r} is not a shardtune sweep's state (no spec and trials); {fix}")
    for name, record in saved["trials"].items():
        ok = isinstance(record, dict) and record.get("name") == name and all(
            isinstance(record.get(k), tp) and not isinstance(record.get(k), bool) for k, tp in RECORD_TYPES.items())
        ok = ok and all(record.get(k) is None or (isinstance(record[k], (int, float))
                                                  and not isinstance(record[k], bool)) for k in NUMBER_FIELDS)
        if not ok:
            raise UserError(f"{str(path)!r} holds a damaged trial record {str(name)[:60]!r}; {fix}")
    return saved


def set_device(sweep: Sweep) -> None:
    """The trials' device checked and set on `sweep`, first: the trials' settings (`Sweep.settings`)
    and this machine's checks of the points depend on it."""
    from shardtune.distributed.process_group import check_nproc, resolve_device

    device = sweep.config({}).device
    check_nproc(sweep.nproc, device)
    sweep.device = resolve_device(device).type


def open_folder(sweep: Sweep, kind: str, own_files: tuple[str, ...]) -> None:
    """The sweep's folder made: continue an earlier one (holding only `own_files` and plots), or
    start in a new or empty folder; never write into a run's or a user's folder."""
    refuse_foreign(sweep.out, "--out", kind, lambda name: name in own_files or name.endswith(".png"))
    make_dir(sweep.out)


def run_sweep(sweep: Sweep) -> Path:
    """Validate everything, then run (or take from OUT/sweep.json) each trial; write the outputs."""
    check(sweep)
    open_folder(sweep, "a sweep's", SWEEP_FILES)
    state = State(sweep)
    limit = memory_limit(sweep)
    cap = limit if sweep.device == "cpu" else None  # a GPU's own memory is the real limit there
    points = sweep.points()
    print(f"sweep: {len(points)} grid point(s){', max-batch search' if sweep.max_batch else ''} on "
          f"{sweep.nproc} {sweep.device} rank(s), {sweep.steps} step(s) each -> {sweep.out}"
          + (f" ({len(state.trials)} trial(s) already done)" if state.trials else ""), flush=True)
    predict = Predictions(sweep)
    summaries = []

    def trial(point: dict, micro_batch: int | None, checkpointing: str | None = None) -> dict:
        name = slug(point) + (f"-mb{micro_batch}" if micro_batch is not None else "")
        if name not in state.trials:
            cfg = sweep.config(point, micro_batch, checkpointing)
            predicted = predict(point, micro_batch, checkpointing)
            record = run_trial(sweep, point, name, cap, micro_batch, checkpointing=checkpointing)
            # the micro-batch and checkpointing it ran: a point's `auto` resolved (the point says "auto")
            record.update(micro_batch=cfg.train.micro_batch_size, checkpointing=cfg.activation_checkpointing,
                          predicted_gib=predicted and predicted / GIB,
                          accumulation=cfg.train.global_batch_size // (cfg.train.micro_batch_size * sweep.nproc))
            state.add(record)
            print(f"  {describe(record)}", flush=True)
        return state.trials[name]

    try:
        for point in points:
            done = list(state.trials.values())
            summaries.append(max_batch_of(sweep, point, trial, predict, limit, done) if sweep.max_batch
                             else one_trial_of(sweep, point, trial, limit, done))
    finally:  # also after an interrupt: what is done is written; a point nothing fits is in no trial of sweep.json
        unfit = [s["record"] for s in summaries if s["record"] and s["record"]["name"] not in state.trials]
        write_outputs(sweep, [*state.trials.values(), *unfit], summaries, limit)
    return sweep.out / "sweep.md"
