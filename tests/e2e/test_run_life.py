"""A run's life over time, with test_errors.py's harness: how long it trains, where its outputs
and those of the commands about it may go, what its trackers and uploads are given. Each bad
input is one `error: ...` line naming the problem and the fix, exit code 2, nothing already
written destroyed."""

from __future__ import annotations

import shutil

import pytest
from test_errors import _isolated, datasets_cache, fails, out, qs_assets, recipe, snapshot  # noqa: F401
from test_outputs import earlier_run, tree  # noqa: F401 - a finished run with checkpoints

from shardtune.cli.main import main
from shardtune.errors import UserError


@pytest.mark.parametrize("epochs", ["1e308", "1e30"], ids=["overflows", "past-the-counter"])
def test_more_epochs_than_a_step_counter_holds(capfd, recipe, out, epochs):
    """train.epochs is a float: times the data's steps per epoch it overflowed to infinity (an
    OverflowError traceback) or passed 2**63-1 steps."""
    before = snapshot(out)
    fails(capfd, ["train", recipe, f"output_dir={out}", "train.max_steps=0", f"train.epochs={epochs}"],
          f"train.epochs={float(epochs):g}", "per epoch", "2**63-1", "train.max_steps")
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- outputs of the commands about a run


def test_no_command_writes_inside_a_runs_own_folders(capfd, earlier_run, recipe, tmp_path):
    """report --out, sweep --out, slurm -o and eval --generate --out inside a run's checkpoints/,
    final/, profile/ or publish/ would go with that run's --overwrite or be replaced by its saves:
    refused in one line like output_dir and export's folder (`fsio.refuse_inside_run`, called by
    the checks of every command's output), nothing written."""
    from shardtune.fsio import refuse_foreign_file

    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    before = tree(run)
    fails(capfd, ["report", str(run), "--out", str(run / "checkpoints" / "report")], "report folder",
          "inside checkpoints/ of the run", "choose another report folder outside it")
    fails(capfd, ["sweep", recipe, "--grid", "train.lr=1e-3,2e-3", "--out", str(run / "profile"), "--steps", "1"],
          "--out", "inside profile/ of the run")
    fails(capfd, ["slurm", recipe, "--nodes", "1", "--gpus-per-node", "1", "-o", str(run / "final" / "job.sh")],
          "-o", "inside final/ of the run")
    with pytest.raises(UserError, match="inside publish/ of the run"):  # eval --generate --out's check
        refuse_foreign_file(run / "publish" / "generation.json", "--out", "an output of `eval --generate`", "mark")
    assert tree(run) == before
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0  # beside it: fine


def test_a_resume_whose_epochs_end_before_its_checkpoint_is_refused(capfd, earlier_run, recipe, tmp_path):
    """As train.max_steps below the checkpoint's step is: fewer epochs than the checkpoint has
    trained resumed, trained nothing and rewrote final/ with exit 0."""
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    before = tree(run)
    fails(capfd, ["train", recipe, f"output_dir={run}", "resume=auto", "train.max_steps=0", "train.epochs=0.001",
                  "checkpoint.every_steps=1", "checkpoint.keep_last=0", "eval.every_steps=0"],
          "train.epochs=0.001 is 1 step(s) of this data", "(2, ", "raise train.epochs or set train.max_steps")
    assert tree(run) == before


@pytest.mark.parametrize("tracker, folder", [("tensorboard", "tensorboard"), ("mlflow", "mlruns"),
                                             ("wandb", "wandb")])
def test_a_tracker_whose_folder_is_a_file_is_refused_before_the_build(capfd, monkeypatch, recipe, out, tracker,
                                                                       folder):
    """Refused once the model was built, on a line that said to fix the tracker's settings (MLflow
    wrote its store somewhere else and the run went on)."""
    pytest.importorskip(tracker)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    (out / folder).write_text("mine\n")
    before = snapshot(out)
    line = fails(capfd, ["train", recipe, f"output_dir={out}", f"log.trackers=[{tracker}]"],
                 f"log.trackers: {tracker} writes into {str(out / folder)!r}, which is a file", "move that file")
    assert "model:" not in capfd.readouterr().out + line
    assert snapshot(out) == before
