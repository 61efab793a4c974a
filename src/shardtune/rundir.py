"""The output folder of a run: its default name, refusing to clobber an earlier run, and getting
it ready for a fresh start or a resume (which checkpoint, stale partial saves, trimmed metrics)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .checkpoint import check_compatible, find_latest, read_meta, resolve_checkpoint
from .errors import UserError
from .signals import PREEMPTED_MARKER

RUN_FILES = ("config.yaml", "metrics.jsonl", PREEMPTED_MARKER)
RUN_DIRS = ("final", "checkpoints")


def default_output_dir(recipe: str | None) -> str:
    return str(Path("runs") / f"{recipe or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")


def holds_run(out: Path) -> bool:
    return any((out / name).exists() for name in RUN_FILES + RUN_DIRS)


def claim_output_dir(out: Path, overwrite: bool, check_only: bool = False, resuming: bool = False) -> None:
    """Refuse a folder that already holds a run unless `overwrite` (or `resuming` it); then remove
    only the run's own files (never anything else the user keeps there). `check_only` changes nothing."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {str(out)!r} is a file; choose another output_dir")
    if resuming:
        overwrite = False  # a resumed run keeps its files
    elif holds_run(out):
        if not overwrite and (out / "checkpoints").is_dir():
            raise UserError(f"output_dir {str(out)!r} holds checkpoints of an earlier run; pass resume=auto "
                            "to continue it, or --overwrite to start over")
        if not overwrite:
            raise UserError(f"output_dir {str(out)!r} already holds a run; choose another output_dir "
                            "or pass --overwrite to replace it")
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        for name in RUN_DIRS:
            shutil.rmtree(out / name, ignore_errors=True)
    if not check_only:
        out.mkdir(parents=True, exist_ok=True)


def prepare_run_dir(cfg, overwrite: bool, check_only: bool = False) -> str | None:
    """Rank 0, before anything is built: the checkpoint to resume from (or None), with the
    output folder claimed. Conflicts and bad checkpoints are UserErrors here, not later."""
    out = Path(cfg.output_dir)
    ckpt = None
    if cfg.resume is not None and overwrite:
        raise UserError(f"resume={cfg.resume} continues a run and --overwrite deletes it; drop one of them")
    if cfg.resume == "auto":
        ckpt = find_latest(out / "checkpoints")
        if ckpt is None and (out / "final").is_dir():
            raise UserError(f"resume=auto: output_dir {str(out)!r} holds a finished run and no checkpoint; "
                            "pass --overwrite (without resume) to start over")
    elif cfg.resume:
        ckpt = resolve_checkpoint(cfg.resume)
        inside = out.resolve() in ckpt.resolve().parents
        if not inside and holds_run(out):
            raise UserError(f"output_dir {str(out)!r} holds another run; resume {str(ckpt)!r} into a new output_dir")
    step = read_meta(ckpt)["step"] if ckpt is not None else 0
    if ckpt is not None:
        check_compatible(read_meta(ckpt)["config"], cfg.to_dict(), ckpt)
    # resume=auto with nothing to resume starts from scratch, so a requeue script works from its first launch.
    claim_output_dir(out, overwrite or (cfg.resume == "auto" and ckpt is None), check_only,
                     resuming=ckpt is not None)
    if check_only:
        return str(ckpt) if ckpt else None
    root = out / "checkpoints"
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")] if root.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)  # saves cut short by a kill
    if ckpt is not None:
        trim_metrics(out / "metrics.jsonl", step)
        print(f"resuming from {ckpt} (step {step})", flush=True)
    elif cfg.resume == "auto":
        print(f"resume=auto: no checkpoint in {out / 'checkpoints'}; starting from step 0", flush=True)
    return str(ckpt) if ckpt else None


def trim_metrics(path: Path, step: int) -> None:
    """Drop records of steps after `step`: the resumed run writes them again."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except ValueError:  # a line cut short by a kill
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
