"""`shardtune sweep --search`: a hyperparameter search with Optuna (TPE or random sampling, a
pruner on the validation loss) over any config keys. Every trial is a real `shardtune train`
process, as in the grid sweep (sweep/trial.py), so a crash or an out-of-memory is a failed trial,
not the end of the search; a pruned trial is killed while it runs. The study lives in a database
(SQLite in the sweep folder by default, any SQLAlchemy URL for a shared one): a killed search
resumes with the same command, and several machines can work on one study."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import re
import warnings
from pathlib import Path

from shardtune.errors import UserError, first_line
from shardtune.fsio import json_loads
from shardtune.sweep.grid import (
    Sweep,
    check_mem_limit,
    check_overrides,
    check_trial,
    open_folder,
    run_key,
    set_device,
)
from shardtune.sweep.max_batch import auto_layout, memory_limit
from shardtune.sweep.space import Param, check_kind
from shardtune.sweep.trial import not_run, run_trial

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "none")
OBJECTIVES = {"val_loss": "eval_loss", "eval_loss": "eval_loss", "val_ppl": "eval_ppl", "eval_ppl": "eval_ppl"}
FINISHED = ("COMPLETE", "PRUNED", "FAIL")  # trial states that count towards --trials (`counts`)
SEARCH_FILES = ("study.db", "study.db-journal", "search.csv", "search.md", "trials")  # with the plots
HEARTBEAT_S = 10  # a trial whose worker stopped beating this many x 3 seconds ago is marked failed


class TrialFailed(Exception):
    """A trial that ended without an objective value (crash, out of memory, no validation)."""


@dataclasses.dataclass
class Search:
    space: list[Param]
    trials: int = 20
    objective: str = "val_loss"
    sampler: str = "tpe"
    pruner: str = "median"
    storage: str | None = None  # default: sqlite:///OUT/study.db
    study_name: str | None = None  # default: the sweep folder's name
    seed: int = 0

    def spec(self) -> dict:
        """What must match for a rerun (or another machine) to join the study."""
        return {"space": {p.key: p.spec() for p in self.space}, "objective": OBJECTIVES[self.objective]}


def make_sampler(search: Search):
    """The sampler, seeded per trial by (--seed, the trial's number). One seeded once drew the same
    sequence in every process: a resumed search (and TPE's random start-up trials) repeated the
    values of the first trials, and two machines on one --storage ran the same trials side by side."""
    import numpy as np
    import optuna

    def made(number: int | None):
        if number is not None:
            seed = int(np.random.SeedSequence([search.seed, number]).generate_state(1)[0])
        else:
            seed = search.seed
        if search.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, search.trials // 3)))

    class PerTrialSeed(optuna.samplers.BaseSampler):
        """Optuna's sampler, made afresh for each trial (its only state between trials is its random state)."""

        def __init__(self):
            self.inner = made(None)

        def before_trial(self, study, trial):  # trial numbers are unique in a study, across workers
            self.inner = made(trial.number)
            self.inner.before_trial(study, trial)

        def infer_relative_search_space(self, study, trial):
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def after_trial(self, study, trial, state, values):
            self.inner.after_trial(study, trial, state, values)

        def reseed_rng(self):
            self.inner.reseed_rng()

    return PerTrialSeed()


def make_pruner(search: Search):
    import optuna

    if search.pruner == "none":
        return optuna.pruners.NopPruner()
    if search.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)


def check(sweep: Sweep, search: Search) -> None:
    """Everything that can be refused before a trial starts."""
    if search.trials < 1:
        raise UserError(f"--trials must be at least 1, got {search.trials}")
    if search.objective not in OBJECTIVES:
        raise UserError(f"unknown --objective {search.objective!r}; choose from {', '.join(OBJECTIVES)}")
    if search.sampler not in SAMPLERS:
        raise UserError(f"unknown --sampler {search.sampler!r}; choose from {', '.join(SAMPLERS)}")
    if search.pruner not in PRUNERS:
        raise UserError(f"unknown --pruner {search.pruner!r}; choose from {', '.join(PRUNERS)}")
    if not search.space:
        raise UserError("nothing to search; give --search KEY=DISTRIBUTION:LOW:HIGH")
    if sweep.steps < 1 or (sweep.eval_steps is not None and not 1 <= sweep.eval_steps <= sweep.steps):
        raise UserError("--search needs --steps >= 1 and 1 <= --eval-steps <= --steps (the validation loss "
                        "the pruner watches is taken every --eval-steps)")
    set_device(sweep)
    check_mem_limit(sweep)
    check_overrides(sweep, [p.key for p in search.space], "--search")
    sweep.config({})  # the recipe and overrides alone: their errors are not the search space's
    for param in search.space:
        check_kind(param)
        runs: dict[str, str] = {}  # as the grid's values: two choices that load as one run are refused
        for value in param.checked():
            try:
                cfg = sweep.config({param.key: value})
                if (same := runs.setdefault(run_key(cfg), value)) != value:
                    raise UserError(f"it is the same run as {param.key}={same} (the values mean the same); "
                                    "list each choice once")
                check_trial(sweep, cfg)
            except UserError as exc:
                raise UserError(f"--search {param.key}={value}: {exc}") from None
    from shardtune.sweep.grid import check_models

    check_models(sweep, [{p.key: value} for p in search.space for value in p.checked()], "--search")


@contextlib.contextmanager
def foreign_storage(name: str, url: str):
    """optuna's and sqlalchemy's errors for a foreign database or a study it cannot join: one line."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc  # optuna wraps the database's own error, which says what is wrong
        raise UserError(f"cannot use study {name!r} in --storage {url!r} ({type(cause).__name__}: "
                        f"{first_line(cause, 160)}); give a --storage of Optuna's own (a new file is made), or "
                        "another --study-name") from None


def open_study(sweep: Sweep, search: Search):
    """The study in its storage (created, or joined when it exists with the same spec)."""
    import optuna

    url = search.storage or f"sqlite:///{(sweep.out / 'study.db').resolve()}"
    try:
        with warnings.catch_warnings():  # heartbeats are "experimental" in optuna; the warning is noise here
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=3 * HEARTBEAT_S)
    except Exception as exc:  # noqa: BLE001  sqlalchemy's many errors for a URL it cannot open
        raise UserError(f"cannot open --storage {url!r} ({first_line(exc, 160)}); give a SQLAlchemy URL such as "
                        "sqlite:///study.db or postgresql://host/db") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # its warnings through logging's last resort, which writes to the stderr of the moment, not
    # to the one optuna's own handler kept from when it was made
    optuna.logging.disable_default_handler()
    name = search.study_name or sweep.out.resolve().name
    with foreign_storage(name, url):  # a database that opens may still not be Optuna's (another schema)
        known = name in optuna.study.get_all_study_names(storage)
    if not known and (left := trial_folders(sweep, name)):
        raise UserError(f"{sweep.out / 'trials'} holds {len(left)} trial folder(s) of a study {name!r} that "
                        f"--storage {url!r} does not have (another storage, or its database removed): a new study "
                        "would run its trials over them; give that study's --storage, another --out, or another "
                        "--study-name")
    with foreign_storage(name, url):  # or hold a study it cannot join
        study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True, direction="minimize",
                                    sampler=make_sampler(search), pruner=make_pruner(search))
        saved = study.user_attrs.get("spec")
    spec = json_loads(json.dumps({**search.spec(), "trial": sweep.spec()}))  # as read back from the storage
    if saved is None:
        study.set_user_attr("spec", spec)
    elif saved != spec:
        trial = saved.get("trial") if isinstance(saved.get("trial"), dict) else {}
        changed = [k for k in spec if k != "trial" and saved.get(k) != spec[k]]
        changed += [k for k in spec["trial"] if trial.get(k) != spec["trial"][k]]
        raise UserError(f"study {name!r} in {url} was searched with another {', '.join(changed or ['settings'])}; "
                        "rerun its own command to continue it, or give this one another --out or --study-name")
    return study


def reporter(trial, key: str):
    """`watch` for run_trial: report each new validation value to the pruner; True = stop."""
    seen = set()

    def watch(folder: Path) -> bool:
        for row in metrics_so_far(folder):
            step = row.get("step")
            if key in row and isinstance(step, int) and step > 0 and step not in seen:
                seen.add(step)
                trial.report(row[key], step)
                if trial.should_prune():
                    return True
        return False

    return watch


def metrics_so_far(folder: Path) -> list[dict]:
    """The rows of a running trial's metrics.jsonl (a line still being written is left out)."""
    path = folder / "metrics.jsonl"
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json_loads(line)
        except json.JSONDecodeError:
            break
        if isinstance(row, dict):  # the trial's own lines are objects
            rows.append(row)
    return rows


def objective_of(sweep: Sweep, search: Search, cap):
    import optuna

    key = OBJECTIVES[search.objective]

    def objective(trial) -> float:
        point = {p.key: str(p.suggest(trial)) for p in search.space}
        name = trial_folder(sweep, trial.study.study_name, trial.number)
        # the point's micro_batch_size/activation_checkpointing=auto resolved within --mem-limit, as the
        # grid's: left to the trial, they were chosen against the machine's free RAM and ran out of the cap
        records = [t.user_attrs["record"] for t in trial.study.get_trials(deepcopy=False) if "record" in t.user_attrs]
        try:
            micro_batch, mode = auto_layout(sweep, point, memory_limit(sweep), records)
        except UserError as exc:  # no layout of this point fits: a failed trial, not the end of the search
            record = not_run(point, name, str(exc))
        else:
            record = run_trial(sweep, point, name, cap, micro_batch, watch=reporter(trial, key), checkpointing=mode)
        values = [r[key] for r in metrics_so_far(sweep.out / "trials" / record["name"]) if key in r]
        # a run without a finite value fails with the reason in its record (search.csv's note): optuna
        # failed a NaN quietly, and the table said neither why nor, for no value, anything
        if record["status"] == "ok" and not values:
            record.update(status="failed", note=f"the trial logged no {key}; does the data have a validation split?")
        elif record["status"] == "ok" and not math.isfinite(values[-1]):
            record.update(status="failed", note=f"{key} is {values[-1]}: the run diverged")
        trial.set_user_attr("record", json_loads(json.dumps(record, default=str)))
        print(f"  trial {trial.number}: {' '.join(f'{k}={v}' for k, v in point.items())} -> "
              f"{record['status']}" + (f" ({record['note']})" if record.get("note") else ""), flush=True)
        if record["status"] == "pruned":
            raise optuna.TrialPruned()
        if record["status"] != "ok":
            raise TrialFailed(record.get("note") or record["status"])
        print(f"    {key} = {values[-1]:.4f}", flush=True)
        return float(values[-1])

    return objective


def trial_folder(sweep: Sweep, study_name: str, number: int) -> str:
    """A trial's folder under OUT/trials: trial-NNNN for the folder's own study (its name), else
    the study's name beside the number, so another --study-name in the same --out never reruns
    (and so overwrites) a trial folder of the first study."""
    own = f"trial-{number:04d}"
    if study_name == sweep.out.resolve().name:
        return own
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "", study_name)[:60]
    if safe != study_name:  # two names that lose different characters stay apart
        safe += "-" + hashlib.sha1(study_name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{own}-{safe}"


def trial_folders(sweep: Sweep, study_name: str) -> list[Path]:
    """The folders under OUT/trials that trials of `study_name` are written to (trial_folder's names)."""
    pattern = re.compile(re.escape(trial_folder(sweep, study_name, 0)).replace("0000", r"\d{4,}", 1) + "$")
    trials = sweep.out / "trials"
    return sorted(p for p in trials.iterdir() if pattern.match(p.name)) if trials.is_dir() else []


def counts(trial) -> bool:
    """A trial that counts towards --trials: complete, pruned, or failed after its process ended
    (it has a record). One stopped by Ctrl-C or whose worker died (failed by the heartbeat) says
    nothing of its values; a rerun runs another in its place, as the grid sweep reruns one."""
    return trial.state.name in FINISHED and (trial.state.name != "FAIL" or "record" in trial.user_attrs)


def finished(study) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False) if counts(t))


def run_search(sweep: Sweep, search: Search) -> Path:
    """Validate everything, open (or join) the study, run trials until it has --trials finished
    ones, write the outputs."""
    from shardtune.sweep.search_report import write_search_outputs

    try:
        import optuna  # noqa: F401  here: its absence is one line, before any check
    except ImportError:
        raise UserError("--search needs the 'optuna' package: pip install 'shardtune[tune]'") from None
    check(sweep, search)
    open_folder(sweep, "a search's", SEARCH_FILES)
    study = open_study(sweep, search)
    done = finished(study)
    print(f"search: {search.trials} trial(s) of {', '.join(p.key for p in search.space)} ({search.sampler}, "
          f"pruner {search.pruner}) on {sweep.nproc} {sweep.device} rank(s), {sweep.steps} step(s) each -> "
          f"{sweep.out}" + (f" ({done} already finished)" if done else ""), flush=True)
    cap = sweep.mem_limit if sweep.device == "cpu" else None
    try:
        if done < search.trials:
            def stop(study, _trial) -> None:  # other workers' trials count too
                if finished(study) >= search.trials:
                    study.stop()

            study.optimize(objective_of(sweep, search, cap), n_trials=search.trials - done, catch=(TrialFailed,),
                           callbacks=[stop], gc_after_trial=False)
    finally:  # also after an interrupt: what is done is written
        out = write_search_outputs(sweep, search, study, OBJECTIVES[search.objective])
    return out
