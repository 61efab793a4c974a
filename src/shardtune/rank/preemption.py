"""Inside a rank: stopping a run on request: SIGTERM or SIGUSR1 (what Slurm sends before it kills a job), and
Ctrl-C (SIGINT).

The handler only raises a flag. Once per step every rank adds its flag into the step's
all-reduce, so all ranks see the request at the same step, finish it, write a checkpoint
together and exit with EXIT_PREEMPTED. `resume=auto` then continues from that checkpoint.

Ctrl-C is a request too: the first one stops the run like SIGTERM, with a checkpoint; a second
one stops it at once, without one (KeyboardInterrupt in a lone process; in a rank of several
the default action, since a rank may be waiting in a collective that Python cannot interrupt).
Every message about a stop says whether a checkpoint was written and which one is the last good one.

A process started with SIGINT ignored (`nohup`, `cmd &` in a script) keeps ignoring it, launcher
and ranks alike (the ranks inherit the ignored disposition), like any Unix program started that
way: Ctrl-C never reaches such a run, and SIGTERM still stops it with a checkpoint.

The launcher's side (what it says when its ranks stopped) is `launch.signals`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from shardtune.distributed.process_group import LAUNCHER_ENV, is_main_process, launched_by_agent

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def sigint_ignored() -> bool:
    """This process was started with Ctrl-C ignored, and so ignores it (see the module's docstring)."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


class Preemption:
    """While installed, the signals above set `requested` instead of killing the process; an
    ignored SIGINT stays ignored. `restore()` puts back the handlers the process had, except that
    after a first Ctrl-C the next one stops the process at once until it ends: a rank saving its
    checkpoint or running its exit handlers dies by SIGINT, no KeyboardInterrupt traceback."""

    def __init__(self):
        self.requested = 0
        self.signum: int | None = None
        self._old: dict = {}
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            for sig in SIGNALS:
                if sig != signal.SIGINT or not sigint_ignored():
                    self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            # The second Ctrl-C: at once. A lone process gets its own handler back (Python's
            # KeyboardInterrupt: it unwinds and the CLI says what is left); a rank dies by the
            # default action (its launcher says it): it may be inside a collective.
            old = self._old.get(signal.SIGINT)
            lone = not launched_by_agent()
            signal.signal(signal.SIGINT, (old if old is not None else signal.default_int_handler) if lone
                          else signal.SIG_DFL)
            if is_main_process() and LAUNCHER_ENV not in os.environ:
                say_from_handler("Ctrl-C: finishing the steps under way and saving a checkpoint; "
                                 "Ctrl-C again stops at once, without one")
        if not self.requested:
            self.requested, self.signum = 1, signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a preemption request"

    def stopped_with_a_peer(self, exc: BaseException, world_size: int) -> None:
        """After a Ctrl-C, in a run of several ranks, a collective that failed (gloo's "Connection
        reset by peer", NCCL's errors, DCP's failed save) failed because the launcher is stopping
        the ranks at once and another rank died first: this rank dies by SIGINT too, as the second
        Ctrl-C would have made it a moment later, with no traceback (the launcher says what is on
        disk). Any other error, or one before a Ctrl-C, is left to propagate."""
        if world_size < 2 or self.signum != signal.SIGINT or not _from_the_process_group(exc):
            return
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)

    def restore(self) -> None:
        for sig, old in self._old.items():
            if sig != signal.SIGINT or signal.getsignal(sig) == self._handle:  # not yet pressed once
                signal.signal(sig, old)
        self._old = {}


@contextlib.contextmanager
def held_through(what: str):
    """SIGTERM and SIGUSR1 (a stop request, Slurm's warning before the time limit) wait while `what` is
    written once training has ended (a run's final/: bounded, and atomic): killed halfway, a rank lost
    it, and the run its steps since the last checkpoint, while the job's script saw no preemption and
    did not requeue. The process's own handlers come back after; the run ends as completed, and says so."""
    got: list[int] = []
    held = {}
    if threading.current_thread() is threading.main_thread():  # Python only allows it there
        held = {sig: signal.signal(sig, lambda signum, frame: got.append(signum))
                for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, old in held.items():
            signal.signal(sig, old)
    if got and is_main_process():
        print(f"{signal.Signals(got[0]).name} while {what} was written: finished writing it; the run is complete",
              file=sys.stderr, flush=True)


def say_from_handler(text: str) -> None:
    """A line on stderr from a signal handler: os.write, as print may be in use when it runs. A
    stderr without a descriptor (a notebook's, a caller's StringIO) writes to descriptor 2, and a
    reader gone is silence: raised here, the error surfaced inside the step the signal interrupted,
    and the Ctrl-C meant to stop the run with a checkpoint crashed it without one."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        fd = 2
    try:
        os.write(fd, (text + "\n").encode())
    except OSError:
        pass


def _from_the_process_group(exc: BaseException) -> bool:
    from torch.distributed import DistError
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError | CheckpointException) and any(
        word in text for word in ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer"))


def last_good(out: Path | str | None) -> str:
    """Where a resume would continue from, as the end of a sentence."""
    from shardtune.checkpoint.folders import find_latest

    good = find_latest(Path(out) / "checkpoints") if out else None
    return f"the last good checkpoint is {good} (resume=auto continues from it)" if good else \
        "this run has no checkpoint"


def interrupted_line(out: Path | str | None) -> str:
    return f"interrupted (Ctrl-C): stopped at once, without a checkpoint; {last_good(out)}"
