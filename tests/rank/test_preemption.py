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


class Killed(Exception):
    """Stands for the default action of SIGTERM/SIGUSR1: the process dies where it is."""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_during_the_final_save_waits_for_it(monkeypatch, capsys, assets, tmp_path, signum):
    """Slurm's warning (SIGUSR1, --signal-lead before the limit) or a SIGTERM that came while final/ was
    written, after the last step: the handlers were back to the default, the rank died, final/ was never
    written, the steps since the last checkpoint were lost and the job's script, seeing no preemption,
    did not requeue. The save now finishes first, and the run ends complete."""
    import shardtune.checkpoint.final as final_lib
    from conftest import tiny_overrides
    from shardtune.cli.main import main

    def die(sig, frame):
        raise Killed(sig)
    before = {sig: signal.signal(sig, die) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    saving = final_lib.save_hf_folder

    def signalled_midway(state_dict, hf_config, tokenizer, out, *args, **kwargs):
        os.kill(os.getpid(), signum)
        return saving(state_dict, hf_config, tokenizer, out, *args, **kwargs)
    monkeypatch.setattr(final_lib, "save_hf_folder", signalled_midway)
    out = tmp_path / "run"
    try:
        code = main(["train", *tiny_overrides(assets, out, **{"train.max_steps": 2, "eval.max_batches": 1})])
        assert signal.getsignal(signal.SIGTERM) is die and signal.getsignal(signal.SIGUSR1) is die
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert code == 0 and (out / "final" / "config.json").is_file(), err
    assert f"{signal.Signals(signum).name} while {out / 'final'} was written: finished writing it" in err
