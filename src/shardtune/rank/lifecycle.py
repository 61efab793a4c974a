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
# A rank that ends on an error leaves its word for the launcher there too (`leave_note`).
COMPLETED_ENV = "SHARDTUNE_COMPLETED_DIR"
# What a rank that fails leaves for the launcher: its bad-input line (a rank other than 0, which
# alone prints the job's line, may be the only one that has it), or that a peer left first.
ERROR_NOTE, PEER_NOTE = "error", "peer"
# A collective whose peer is gone (its process died or left): gloo's and NCCL's words for it.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def mark_completed(code: int) -> None:
    """A rank of `launch_local`, after the run's closing barrier: tell the launcher the run
    completed with `code`, whatever happens to this process from here on."""
    folder = os.environ.get(COMPLETED_ENV)
    if folder:
        tmp = Path(folder) / f".rank-{os.environ.get('RANK', '0')}"
        tmp.write_text(str(code))
        os.replace(tmp, tmp.with_name(tmp.name[1:]))


def leave_note(kind: str, text: str = "") -> None:
    """A rank of `launch_local` that ends on an error: `kind` ERROR_NOTE with its one line, or
    PEER_NOTE (a collective failed because another rank had died or left first). A rank of plain
    torchrun leaves its bad-input line in its elastic error file instead, whose message torchrun's
    failure summary shows as that rank's ("Root Cause"): rank 0 prints the job's line, and may not
    have this one (a data path missing on one node only)."""
    folder = os.environ.get(COMPLETED_ENV)
    if not folder:
        if kind == ERROR_NOTE:
            _elastic_error_file(f"error: {text}")
        return
    tmp = Path(folder) / f".{kind}-rank-{os.environ.get('RANK', '0')}"
    try:
        tmp.write_text(text)
        os.replace(tmp, tmp.with_name(tmp.name[1:]))
    except OSError:
        pass  # the launcher then says less, never wrongly


def _elastic_error_file(line: str) -> None:
    """`line` as this rank's error in $TORCHELASTIC_ERROR_FILE, in the layout torch's elastic
    `ErrorHandler.record_exception` writes (with the line where it puts a traceback)."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                               "timestamp": str(int(time.time()))}}}
        try:
            Path(path).write_text(json.dumps(record))
        except OSError:
            pass  # torchrun's summary then says <N/A>, as without it


def failed_with_a_peer(exc: BaseException) -> bool:
    """In a rank of several: `exc` is a collective failing because another rank died or left
    first (that rank's own output and its launcher tell why); this rank's traceback would only
    bury that line."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "0", "1"):
        return False
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while exc is not None and id(exc) not in seen:  # the collective's error, or one that retells it
        seen.add(id(exc))
        # torch's errors (RuntimeError, DistError, DCP's), not a socket's own (an OSError: a Hub upload's)
        if isinstance(exc, RuntimeError | CheckpointException) and any(words in str(exc) for words in PEER_GONE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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
