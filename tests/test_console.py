"""The console when its reader leaves (`shardtune plan | head -3`): no traceback, ever; a command
whose product is what it prints stops at once (141), one that makes files goes on without a
console. In-process over a real pipe, and two commands end to end."""

from __future__ import annotations

import argparse
import errno
import io
import os
import subprocess
import sys

import pytest

from conftest import ROOT, child_env, tiny_overrides
from shardtune.cli.main import COMMANDS, PRINTS_ITS_PRODUCT, stops_when_reader_leaves
from shardtune.console import ReaderLeft, guarded_console
from shardtune.errors import EXIT_READER_LEFT


@pytest.fixture
def closed_pipe():
    """A stream writing to a pipe whose reading end is already closed, as after `| head`; a test
    sets it as sys.stdout in its body (pytest's capture sets sys.stdout again after fixtures)."""
    read, write = os.pipe()
    os.close(read)
    stream = io.TextIOWrapper(io.FileIO(write, "w"), line_buffering=True)
    yield stream
    stream.close()


def points_at_devnull(stream) -> bool:
    return os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))


def test_a_command_that_makes_files_goes_on_without_its_console(monkeypatch, closed_pipe):
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    with guarded_console() as console:
        console.stop = False
        for i in range(3):
            print("line", i, "x" * 100_000)  # larger than any pipe's buffer
        assert sys.stdout.reader_left
    assert sys.stdout is closed_pipe and points_at_devnull(closed_pipe)
    print("after the block")  # the interpreter's last flush will not fail either
    closed_pipe.flush()


def test_a_command_that_prints_its_product_stops_quietly(monkeypatch, closed_pipe):
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    with pytest.raises(ReaderLeft) as stopped, guarded_console() as console:
        console.stop = True
        print("the answer")
        pytest.fail("went on after its reader left")
    assert stopped.value.code == EXIT_READER_LEFT == 141
    assert points_at_devnull(closed_pipe)


def test_a_reader_of_stderr_leaving_never_stops_a_command(monkeypatch, closed_pipe):
    monkeypatch.setattr(sys, "stderr", closed_pipe)
    with guarded_console() as console:
        console.stop = True
        print("a warning", file=sys.stderr)
        assert sys.stderr.reader_left


def test_other_failures_of_the_console_are_not_taken_for_a_reader_leaving(monkeypatch):
    """A full disk under `> file` is the filesystem failing (cli.main names the path), not a reader."""
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(OSError, match="No space"), guarded_console():
        print("x")


def test_a_log_handler_closing_its_stream_leaves_the_console_open(monkeypatch):
    """absl's handler (rouge-score sets it up: `eval --generate`) closes the stream it took at exit
    unless that is sys.stderr then, which the wrapper no longer is: stderr was closed, and a rank of
    torchrun died flushing it on its way out (lifecycle.leave_rank)."""
    absl_logging = pytest.importorskip("absl.logging")
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with guarded_console():
        handler = absl_logging.PythonHandler(stream=sys.stderr)
        handler.stream.write("a line\n")
    handler.close()
    assert not stream.closed and stream.getvalue() == "a line\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_which_commands_stop(monkeypatch, command):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prints_product = command in PRINTS_ITS_PRODUCT
    assert stops_when_reader_leaves(argparse.Namespace(command=command)) is prints_product
    assert not stops_when_reader_leaves(argparse.Namespace(command=command, out="result.json"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not stops_when_reader_leaves(argparse.Namespace(command=command))


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardtune", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)


def test_plan_piped_into_head_ends_at_once_without_a_traceback(assets, tmp_path):
    proc = _start(["plan", *tiny_overrides(assets, tmp_path / "run"), "--gpus", "1", "--gpu-mem", "16GiB"])
    first = proc.stdout.readline()
    proc.stdout.close()  # `head -1` leaves
    _, err = proc.communicate(timeout=300)
    assert first and proc.returncode == EXIT_READER_LEFT, (first, err)
    assert "Traceback" not in err and "Error" not in err, err


def test_training_goes_on_when_its_console_is_closed(assets, tmp_path):
    out = tmp_path / "run"
    proc = _start(["train", *tiny_overrides(assets, out, **{"log.every_steps": 1})])
    proc.stdout.close()  # nobody ever reads: the first line already fails
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert (out / "final" / "config.json").is_file()
