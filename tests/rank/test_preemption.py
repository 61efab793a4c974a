"""rank/preemption.py: a stop request taken in a signal handler, whatever stderr is."""

from __future__ import annotations

import io
import os
import signal

import pytest


def _closed_pipe():
    read, write = os.pipe()
    os.close(read)  # the reader is gone (`shardtune train ... | head`)
    return os.fdopen(write, "w")


@pytest.mark.parametrize("stderr", [io.StringIO, _closed_pipe], ids=["no-descriptor", "reader-gone"])
def test_ctrl_c_is_a_stop_request_whatever_stderr_is(monkeypatch, stderr):
    """The first Ctrl-C's line went to stderr's descriptor from the handler: a notebook's stderr (or a
    caller's StringIO) has none, a pipe whose reader left refuses it, and the error raised inside
    the step the signal interrupted crashed the run without the checkpoint the Ctrl-C asks for."""
    from shardtune.distributed.process_group import LAUNCHER_ENV
    from shardtune.rank.preemption import Preemption

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    stream = stderr()
    monkeypatch.setattr("sys.stderr", stream)
    # as from a terminal: under `nohup` or `&` the suite starts with SIGINT ignored, which Preemption keeps
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = Preemption()
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, in this thread
        assert (stop.requested, stop.name) == (1, "SIGINT")
        stop.restore()
    finally:
        signal.signal(signal.SIGINT, before)
        stream.close()
