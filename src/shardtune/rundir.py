"""The output folder of a run: its default name, and refusing to clobber an earlier run."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from .errors import UserError

RUN_FILES = ("config.yaml", "metrics.jsonl", "PREEMPTED")
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
