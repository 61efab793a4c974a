"""The output folder of a run: its default name, one live run at a time (an exclusive lock held
for the run's lifetime), refusing to clobber an earlier run, and getting it ready for a fresh
start or a resume (which checkpoint, stale partial saves, trimmed metrics, an attempt without a
checkpoint moved aside)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from pathlib import Path

from shardtune.checkpoint.folders import (
    check_compatible,
    find_latest,
    finish_interrupted_saves,
    read_meta,
    resolve_checkpoint,
    step_of,
    why_no_checkpoint,
)
from shardtune.distributed.process_group import LAUNCHER_ENV
from shardtune.errors import UserError
from shardtune.fsio import (
    PARTIAL,
    RUN_DIRS,
    RUN_MARKS,
    RUN_OUTPUT_DIRS,
    json_loads,
    refuse_inside_run,
    refuse_non_folder,
    write_text_atomic,
)
from shardtune.telemetry.trackers import RUN_IDS

# left in the output folder by a preempted run, for job scripts that cannot see the ranks' exit code
PREEMPTED_MARKER = "PREEMPTED"
RUN_FILES = (*RUN_MARKS, PREEMPTED_MARKER)
# written in a run's folder by its trackers and by the commands about it (report, eval --generate): they
# describe that run, so they go with it when --overwrite replaces it or resume=auto moves it aside
RUN_OUTPUTS = (*RUN_OUTPUT_DIRS, RUN_IDS, "generation.json")
EARLIER = "earlier-attempt-"  # OUT/earlier-attempt-N: an attempt without a usable checkpoint, kept
LOCK_FILE = ".shardtune.lock"  # "pid P on HOST since TIME" of the live run; removed when it ends


def default_output_dir(recipe: str | None) -> str:
    return str(Path("runs") / f"{recipe or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")


def run_traces(out: Path) -> list[str]:
    """The files and folders of a run in `out` (a dangling link counts: its run is only unmounted)."""
    return [name for name in RUN_FILES + RUN_DIRS if os.path.lexists(out / name)]


def holds_run(out: Path) -> bool:
    return bool(run_traces(out))


def never_started(out: Path) -> bool:
    """A run that stopped before it logged anything (refused at its start by a tracker, stopped
    while it built): its config.yaml and empty metrics.jsonl hold nothing to keep from a new run."""
    metrics = out / "metrics.jsonl"
    return set(run_traces(out)) == set(RUN_MARKS) and metrics.is_file() and metrics.stat().st_size == 0


def refuse_run_file(path: Path, option: str) -> None:
    """An output file onto a run's own record (its config.yaml, metrics.jsonl, preemption mark):
    never replaced, whatever --overwrite says (it allows replacing a file of the command's own, not
    the run it reads). Inside the run's folders: fsio.refuse_foreign_file, which every file output calls."""
    folder = path.resolve().parent
    if path.name in RUN_FILES and all((folder / name).is_file() for name in RUN_MARKS):
        raise UserError(f"{option} {str(path)!r} is the {path.name} of the run in {str(folder)!r}; choose another "
                        f"{option}")


def claim_output_dir(out: Path, overwrite: bool, check_only: bool = False, resuming: bool = False) -> None:
    """Refuse a folder that already holds a run unless `overwrite` (or `resuming` it), or that lies
    inside another run's own folders; then remove only the run's own files (never anything else the
    user keeps there). `check_only` changes nothing."""
    refuse_non_folder(out, "output_dir")
    refuse_inside_run(out, "output_dir")
    if resuming:
        overwrite = False  # a resumed run keeps its files
    elif holds_run(out):
        overwrite = overwrite or never_started(out)
        if not overwrite and (out / "checkpoints").is_dir():
            raise UserError(f"output_dir {str(out)!r} holds checkpoints of an earlier run; pass resume=auto "
                            "to continue it, or --overwrite to start over")
        if not overwrite:
            raise UserError(f"output_dir {str(out)!r} already holds a run; choose another output_dir "
                            "or pass --overwrite to replace it")
        if check_only:  # the run it replaces may be this one's input (its final/ as the model): kept till then
            return
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        for name in RUN_DIRS + RUN_OUTPUTS:
            path = out / name
            if path.is_symlink() or path.is_file():
                path.unlink()  # the link only: never what it points to
            else:
                shutil.rmtree(path, ignore_errors=True)
    if not check_only:
        out.mkdir(parents=True, exist_ok=True)


def prepare_run_dir(cfg, overwrite: bool, check_only: bool = False, out: Path | None = None) -> str | None:
    """Rank 0, before anything is built: the checkpoint to resume from (or None), with the
    output folder (`out`, default cfg.output_dir) claimed. Conflicts and bad checkpoints are
    UserErrors here, not later."""
    out = Path(out or cfg.output_dir)
    ckpt = None
    if cfg.resume is not None and overwrite:
        raise UserError(f"resume={cfg.resume} continues a run and --overwrite deletes it; drop one of them")
    hold_run_dir(out)  # before looking inside: another live run's folder is refused as such
    finish_interrupted_saves(out / "checkpoints")
    earlier: list[str] = []
    if cfg.resume == "auto":
        ckpt = find_latest(out / "checkpoints")
        if ckpt is None:
            # a requeued run always continues: without a usable checkpoint it starts from step 0,
            # and what the earlier attempt wrote is moved aside, never removed or written over
            earlier = run_traces(out)
            earlier += [name for name in RUN_OUTPUTS if earlier and os.path.lexists(out / name)]
    elif cfg.resume:
        ckpt = resolve_checkpoint(cfg.resume)
        inside = out.resolve() in ckpt.resolve().parents
        if not inside and holds_run(out):
            raise UserError(f"output_dir {str(out)!r} holds another run; resume {str(ckpt)!r} into a new output_dir")
    step = read_meta(ckpt)["step"] if ckpt is not None else 0
    if ckpt is not None:
        check_compatible(read_meta(ckpt)["config"], cfg.to_dict(), ckpt)
        if 0 < cfg.train.max_steps < step:  # (equal: a finished run requeued, which ends at once)
            raise UserError(f"train.max_steps={cfg.train.max_steps} is below the step of the checkpoint it resumes "
                            f"({step}, {str(ckpt)!r}): nothing would train; raise train.max_steps, or start over "
                            "in a new output_dir")
    # resume=auto in a folder without a run starts from scratch, so a requeue script works from its first launch.
    claim_output_dir(out, overwrite, check_only,
                     resuming=ckpt is not None or bool(earlier))
    if check_only:
        return str(ckpt) if ckpt else None
    if earlier:
        why = why_no_checkpoint(out / "checkpoints")
        aside = move_aside(out, earlier)
        print(f"resume=auto: no usable checkpoint in {out / 'checkpoints'} ({why}); the earlier attempt's "
              f"{', '.join(earlier)} moved to {aside}; starting from step 0", flush=True)
    root = out / "checkpoints"
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")] if root.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)  # saves cut short by a kill
    for stale in out.glob(f".final{PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)  # a final/ cut short by a kill
    if ckpt is not None:
        trim_metrics(out / "metrics.jsonl", step)
        if ckpt.parent.resolve() == root.resolve() and step_of(ckpt) >= 0:
            # a rewind (resume=PATH of an older checkpoint of this run): `latest` named the abandoned later
            # one, which a requeue (resume=auto) before this run's first save continued, without a word
            write_text_atomic(root / "latest", ckpt.name + "\n", sync=True)
        print(f"resuming from {ckpt} (step {step})", flush=True)
    elif cfg.resume == "auto" and not earlier:
        print(f"resume=auto: no checkpoint in {out / 'checkpoints'}; starting from step 0", flush=True)
    return str(ckpt) if ckpt else None


def move_aside(out: Path, names: list[str]) -> Path:
    """Move the run files `names` of `out` into a new folder OUT/earlier-attempt-N (the first N
    not taken: nothing is written over) and return it."""
    n = 1
    while True:
        aside = out / f"{EARLIER}{n}"
        try:
            aside.mkdir()
            break
        except FileExistsError:
            n += 1
    for name in names:
        try:
            os.rename(out / name, aside / name)
        except OSError as exc:
            raise UserError(f"resume=auto: could not move {str(out / name)!r} aside into {str(aside)!r} "
                            f"({exc.strerror}); nothing was removed; fix the folder's permissions or pass "
                            "--overwrite (without resume) to start over") from None
    return aside


def trim_metrics(path: Path, step: int) -> None:
    """Drop records of steps after `step`: the resumed run writes them again."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json_loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        logged = row.get("step", 0) if isinstance(row, dict) else None  # another line is damage: dropped
        if isinstance(logged, int) and logged <= step:
            keep.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in keep))


# ----------------------------------------------------------------------------- the lock

_held: dict[Path, RunLock] = {}


def hold_run_dir(out: Path) -> None:
    """Create `out` if needed and take this process's exclusive lock on it until
    `release_run_dir` (or the process's end, even by kill -9). Refused with one line naming the
    live run that holds it, unless that is this process or the launcher that started it."""
    key = Path(os.path.abspath(out))
    if key not in _held:
        lock = RunLock(key)
        lock.acquire()
        _held[key] = lock


def release_run_dir(out: Path | str | None) -> None:
    if out is not None:
        lock = _held.pop(Path(os.path.abspath(out)), None)
        if lock is not None:
            lock.release()


class RunLock:
    """filelock's flock on OUT/.shardtune.lock, with the holder's line written into it. The file
    is removed on release, while still held; filelock retries a waiter that locked the removed file."""

    def __init__(self, out: Path):
        from filelock import FileLock

        self.out, self.path = out, out / LOCK_FILE
        self.lock = FileLock(self.path, mode=0o644, thread_local=False, on_acquired=_write_holder)
        self.created: Path | None = None  # the outermost folder made for the run

    def acquire(self) -> None:
        from filelock import Timeout

        self.created = make_output_dir(self.out)
        while True:
            try:
                self.lock.acquire(blocking=False)
                return
            except Timeout:
                try:
                    holder = self.path.read_text(errors="replace").strip() or "another process"
                except FileNotFoundError:
                    continue  # released as we looked: try again
            except OSError as exc:
                self._remove_created()
                raise UserError(f"output_dir {str(self.out)!r} is not writable ({exc.strerror}); "
                                "choose another output_dir") from None
            launcher = os.environ.get(LAUNCHER_ENV)
            if launcher == str(os.getppid()) and holder.startswith(f"pid {launcher} "):
                return  # the launcher that started this rank holds it for the run
            raise UserError(f"output_dir {str(self.out)!r} is in use by a live run ({holder}); wait for it "
                            "to finish or stop it, or choose another output_dir")

    def release(self) -> None:
        if self.lock.is_locked:
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)  # while still locked: the next run makes a new file
            self.lock.release()
        self._remove_created()

    def _remove_created(self) -> None:
        """Folders made for a run that never wrote anything go again."""
        if self.created is None:
            return
        folder = self.out
        while True:
            try:
                folder.rmdir()
            except OSError:
                break
            if folder == self.created:
                break
            folder = folder.parent
        self.created = None


def _write_holder(fd: int) -> None:
    """Who holds the folder, for the line that refuses a second run (a killed holder's line stays
    until the next run locks the file and writes its own)."""
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())


def make_output_dir(out: Path) -> Path | None:
    """Create `out` (and its parents); returns the outermost folder created, None if it existed.
    A folder that cannot be made is a one-line UserError now, before anything is built."""
    if out.is_dir():
        return None
    refuse_non_folder(out, "output_dir")
    first = out
    while not first.parent.exists() and first.parent != first:
        first = first.parent
    if not first.parent.is_dir():
        raise UserError(f"output_dir {str(out)!r} cannot be created: {str(first.parent)!r} is a file, not a folder; "
                        "choose another output_dir")
    try:
        out.mkdir(parents=True)
    except FileExistsError:  # made by a concurrent run; the lock decides who may use it
        return None
    except OSError as exc:
        raise UserError(f"output_dir {str(out)!r} cannot be created ({exc.strerror}: "
                        f"{exc.filename or out}); choose another output_dir") from None
    return first

