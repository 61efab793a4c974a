"""The CLI's entry: what it refuses before any command runs."""

from __future__ import annotations

import pytest

from shardtune.cli.main import main


@pytest.mark.parametrize("argv", [["train", "train.max_steps=1"], ["plan", "--gpus", "1", "--gpu-mem", "16GiB"],
                                  ["report", "run"], ["eval", "model"]])
def test_a_removed_working_directory_is_one_line(monkeypatch, capsys, tmp_path, argv):
    """`rm -rf` of the folder a shell stands in: relative paths mean nothing there, and torch's MKL
    died loading (`Intel oneMKL FATAL ERROR`) before shardtune could say anything."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the working directory cannot be read") and "cd to" in err[0]


@pytest.mark.parametrize("command, argv", [("report", ["report", "run"]), ("plan", ["plan", "--gpus", "1"]),
                                           ("generate", ["generate", "m", "--prompt", "hi"])])
def test_ctrl_c_in_any_command_says_so_in_one_line(monkeypatch, capsys, command, argv):
    """It ended with exit 130 and nothing printed (train's own line names its checkpoints)."""
    import importlib

    from shardtune.errors import EXIT_INTERRUPTED

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(f"shardtune.cli.{command}"), "run", interrupted)
    assert main(argv) == EXIT_INTERRUPTED
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted (Ctrl-C): shardtune {command} stopped before it finished"], err
