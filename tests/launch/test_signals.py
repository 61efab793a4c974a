"""rank/preemption.py and launch/signals.py in one process: the handlers a run installs go back to the ones the process
had (an ignored SIGINT stays ignored), and a launcher's stop report says what is on disk."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shardtune.distributed.process_group import LAUNCHER_ENV
from shardtune.errors import EXIT_PREEMPTED
from shardtune.launch.signals import marker_stamp, stop_report
from shardtune.rank.preemption import Preemption


@pytest.fixture
def keep_sigint():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_requests_a_stop_then_the_handler_the_process_had_comes_back(keep_sigint, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # a lone process
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    signal.signal(signal.SIGINT, mine)
    term = signal.getsignal(signal.SIGTERM)
    preemption = Preemption()
    os.kill(os.getpid(), signal.SIGINT)
    assert preemption.requested == 1 and preemption.name == "SIGINT" and not seen
    assert signal.getsignal(signal.SIGINT) is mine  # the second Ctrl-C: the process's own handler
    os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGINT]
    preemption.restore()
    assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is term


def test_after_a_first_ctrl_c_a_rank_keeps_dying_by_the_next_one_through_its_exit(keep_sigint, monkeypatch):
    """A rank whose run was stopped by Ctrl-C keeps the default action after `restore()`: a second
    Ctrl-C during its checkpoint or exit handlers ends it by SIGINT, not by a KeyboardInterrupt
    traceback from inside an atexit callback (seen in CI). Untouched, restore() gives back Python's."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(LAUNCHER_ENV, "1")  # the launcher speaks, not the rank
    signal.signal(signal.SIGINT, signal.default_int_handler)
    preemption = Preemption()
    os.kill(os.getpid(), signal.SIGINT)
    assert preemption.requested == 1 and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    preemption.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    untouched = Preemption()
    untouched.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # what it found
    signal.signal(signal.SIGINT, signal.default_int_handler)
    Preemption().restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_ctrl_c_stays_ignored(keep_sigint):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preemption = Preemption()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)
    assert preemption.requested == 0
    preemption.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_stop_report_says_what_is_on_disk(tmp_path):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "config.json").write_text("{}")  # an earlier launch's
    time.sleep(0.01)
    stamp, launched = marker_stamp(out), time.time_ns()
    code, line = stop_report(signal.SIGINT, out, stamp, launched)
    assert (code, line) == (130, "SIGINT: the ranks stopped without writing a checkpoint; this run has no "
                                 "checkpoint; exit 130")
    time.sleep(0.05)  # file times come from a coarser clock (one tick, a few ms, behind)
    (out / "final" / "model.safetensors").write_text("")  # written by this launch's ranks
    code, line = stop_report(signal.SIGTERM, out, stamp, launched)
    assert (code, line) == (0, f"SIGTERM: it came after training had ended; {out / 'final'} is written and the "
                               "run is complete")
    (out / "PREEMPTED").write_text("7\n")
    code, line = stop_report(signal.SIGTERM, out, stamp, launched)
    assert code == EXIT_PREEMPTED and f"saved {out / 'checkpoints' / 'step-000007'}" in line, line


@pytest.mark.parametrize("signum, error, dies", [
    (signal.SIGINT, RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2988: Connection reset "
                                 "by peer. This is typically caused by a remote worker hanging"), True),
    (signal.SIGINT, "DistBackendError", True),
    (signal.SIGINT, ValueError("a bug of ours"), False),
    (signal.SIGTERM, RuntimeError("NCCL error: remote process exited"), False),  # no Ctrl-C: a real failure
    (None, RuntimeError("Connection reset by peer"), False),
], ids=["gloo-reset", "dist-error", "other-error", "after-sigterm", "no-stop"])
def test_a_collective_that_fails_after_ctrl_c_dies_by_sigint_without_a_traceback(signum, error, dies):
    """Ctrl-C twice on N ranks: the launcher stops the ranks one after another, and a rank in a
    collective can see its peer's connection close before its own SIGINT arrives (CI, once). After
    a Ctrl-C that failure is the stop itself: the rank dies by SIGINT, as the second Ctrl-C would
    have made it, instead of printing a traceback. Any other error, or one without a Ctrl-C, is
    left to propagate. In a child process: dying is the point."""
    import multiprocessing

    import torch.distributed

    def child():
        preemption = Preemption()
        preemption.signum = signum
        if signum == signal.SIGINT:  # what the first Ctrl-C left a rank with
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        exc = torch.distributed.DistBackendError("peer gone") if error == "DistBackendError" else error
        preemption.stopped_with_a_peer(exc, world_size=1)  # a lone process has no peer: it goes on
        preemption.stopped_with_a_peer(exc, world_size=2)
        os._exit(7)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    assert process.exitcode == (-signal.SIGINT if dies else 7)
