"""The CLI's entry: what it refuses before any command runs."""

from __future__ import annotations

import argparse

import pytest

from conftest import run_cli
from shardtune.cli.main import COMMANDS, main
from shardtune.errors import UserError


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


@pytest.mark.parametrize("argv", [["train", "output_dir=run\udcff/x"], ["export", "ckpt", "out\udcff"],
                                  ["eval", "model\udcff"]])
def test_a_name_that_is_not_utf8_is_one_line(monkeypatch, capsys, tmp_path, argv):
    """A byte like 0xff in a name reaches Python as a lone surrogate: Python's file calls took it,
    the tokenizer's save did not, and a run failed with a traceback once trained (exit 1)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "\\xff" in err[0] and "not UTF-8" in err[0], err
    assert "rename" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_a_one_process_command_refuses_to_be_a_rank_of_several(monkeypatch, capsys, tmp_path, command):
    """Under `torchrun --nproc_per_node 2 -m shardtune CMD`, every rank did all of a one-process
    command: generate and eval --generate printed everything twice (and both wrote --out), export's
    second rank failed ("another process wrote there"). Only train and eval's loss take ranks."""
    from shardtune.cli.common import RANKED, check_one_process

    monkeypatch.setenv("WORLD_SIZE", "2")
    for generate in (None, 3):
        args = argparse.Namespace(command=command, generate=generate)
        if command in RANKED and generate is None:
            check_one_process(args)
        else:
            with pytest.raises(UserError, match=r"runs in one process, and this is one of WORLD_SIZE=2 ranks"):
                check_one_process(args)
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc_per_node 1: a process of its own
    check_one_process(argparse.Namespace(command=command, generate=3))
    if command == "export":  # one line, exit 2, nothing written
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: shardtune export runs in one process"), err
        assert list(tmp_path.iterdir()) == []


def test_an_ascii_locale_runs_in_utf8_mode(tmp_path):
    """LC_ALL=C with PYTHONUTF8=0 makes Python's file names, files and console ASCII: a recipe value
    outside it was a UnicodeEncodeError traceback where it was written. The command starts again
    in UTF-8 mode, and the file holds the value in UTF-8."""
    (tmp_path / "é.yaml").write_text("model:\n  name_or_path: gpt2\ndata:\n  path: wikitext\n"
                                     "output_dir: runs/é 中文 🚀\n", encoding="utf-8")
    proc = run_cli(["slurm", "é.yaml", "--nodes", "1", "--gpus-per-node", "1", "-o", "job é.sbatch"], timeout=60,
                   cwd=tmp_path, env={"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""})
    assert proc.returncode == 0, proc.stderr
    assert "'output_dir=runs/é 中文 🚀'" in (tmp_path / "job é.sbatch").read_text(encoding="utf-8")
    assert "job é.sbatch" in proc.stdout
