"""The launcher's side of a stop: what a launcher whose ranks were stopped by a signal exits with
and says, from what the ranks left on disk. The ranks' side (the request, the agreed stop, the
checkpoint) is `rank.preemption`."""

from __future__ import annotations

import signal
from pathlib import Path

from shardtune.checkpoint.rundir import PREEMPTED_MARKER
from shardtune.errors import EXIT_PREEMPTED
from shardtune.rank.preemption import last_good


def marker_stamp(out: Path) -> float | None:
    """The PREEMPTED marker's mtime (None: absent); a launcher notes it before starting ranks."""
    try:
        return (out / PREEMPTED_MARKER).stat().st_mtime_ns
    except OSError:
        return None


def written_since(folder: Path, since_ns: int) -> bool:
    """Whether any file in `folder` was written at or after `since_ns` (time.time_ns())."""
    try:
        return any(p.stat().st_mtime_ns >= since_ns for p in folder.rglob("*") if p.is_file())
    except OSError:
        return False


def stop_report(signum: int, out: Path, stamp_before: float | None, launched_ns: int) -> tuple[int, str]:
    """What a launcher whose ranks were stopped by signal `signum` exits with and says, from what
    is on disk: 75 and the checkpoint only when the ranks wrote one (a PREEMPTED marker that
    changed since the launch at `launched_ns`); 0 where they wrote final/ (training had ended: a signal
    then waits for it, and the run is complete: nothing for a job script to requeue)."""
    name = signal.Signals(signum).name
    step = None
    if marker_stamp(out) not in (None, stamp_before):
        try:
            step = int((out / PREEMPTED_MARKER).read_text().strip())
        except (OSError, ValueError):
            pass
    if step is not None:
        folder = out / "checkpoints" / f"step-{step:06d}"
        return EXIT_PREEMPTED, (f"{name}: the ranks saved {folder} and stopped; exit {EXIT_PREEMPTED} "
                                "(resume=auto continues)")
    final = out / "final"
    if written_since(final, launched_ns):  # final/ appears whole (atomic_dir), after the last step
        return 0, f"{name}: it came after training had ended; {final} is written and the run is complete"
    code = 128 + signum
    return code, f"{name}: the ranks stopped without writing a checkpoint; {last_good(out)}; exit {code}"
