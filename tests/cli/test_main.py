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
