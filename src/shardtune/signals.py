"""Preemption: SIGTERM or SIGUSR1 (what Slurm sends before it kills a job) ends a run cleanly.

The handler only raises a flag. Once per step every rank adds its flag into the step's
all-reduce, so all ranks see the request at the same step, finish it, write a checkpoint
together and exit with EXIT_PREEMPTED. `resume=auto` then continues from that checkpoint.

EXIT_PREEMPTED = 75 (EX_TEMPFAIL, "temporary failure, try again"): a requeue script can
treat 75 as "requeue me", e.g. `[ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID`.
"""

from __future__ import annotations

import signal
import threading

EXIT_PREEMPTED = 75
# left in the output folder by a preempted run, for job scripts that cannot see the ranks' exit code
PREEMPTED_MARKER = "PREEMPTED"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """While installed, the signals above set `requested` instead of killing the process."""

    def __init__(self):
        self.requested = 0
        self.signum: int | None = None
        self._old: dict = {}
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested, self.signum = 1, signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a preemption request"

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
