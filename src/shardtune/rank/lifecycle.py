"""Inside a rank of an elastic agent (ours or torchrun): the completion mark for the launcher,
leaving without the interpreter's teardown, and dying with the launcher."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from pathlib import Path

from shardtune.distributed.process_group import LAUNCHER_ENV

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# A folder the launcher makes for each launch: a rank that has passed the run's closing barrier
# writes rank-N there, holding the exit code it means to end with. A rank that then dies during
# the interpreter's shutdown (a C++ thread of a library alive at exit) has not failed the run.
COMPLETED_ENV = "SHARDTUNE_COMPLETED_DIR"


def mark_completed(code: int) -> None:
    """A rank of `launch_local`, after the run's closing barrier: tell the launcher the run
    completed with `code`, whatever happens to this process from here on."""
    folder = os.environ.get(COMPLETED_ENV)
    if folder:
        tmp = Path(folder) / f".rank-{os.environ.get('RANK', '0')}"
        tmp.write_text(str(code))
        os.replace(tmp, tmp.with_name(tmp.name[1:]))


def leave_rank(code: int) -> None:
    """A rank of an elastic agent (ours or torchrun) whose command has returned: end now, after
    Python's exit handlers, without the interpreter's teardown, where a library's C++ thread
    still alive at exit aborts the process (`terminate called without an active exception`)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_launcher() -> None:
    """In a worker of an elastic agent (ours or torchrun): be killed when the agent dies, so a
    `kill -9` of the launcher leaves no ranks training on (Linux's parent-death signal)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and int(launcher) != os.getppid():  # it died before the prctl took effect
        os._exit(1)
