"""Outputs: nothing a command did not create is overwritten or removed without --overwrite (a
resume that finds a run but no usable checkpoint moves it aside and starts over; export,
report, sweep, slurm -o and eval --out write only into folders and files of their own kind),
any filesystem failure at any output is one line naming the path
(`shardtune.fsio.fs_failure_line`, the CLI's one handler), and a command that fails half-way
leaves no folder that looks complete (`shardtune.fsio.atomic_dir`).
In-process through `shardtune.cli.main.main`; one tiny run is trained per module and copied.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_errors import _isolated, datasets_cache, fails, qs_assets, recipe, snapshot  # noqa: F401

from conftest import tmpfs
from shardtune.checkpoint.folders import find_latest, why_no_checkpoint
from shardtune.checkpoint.rundir import claim_output_dir, prepare_run_dir, release_run_dir
from shardtune.cli.main import main
from shardtune.config.load import load_config
from shardtune.errors import UserError
from shardtune.fsio import atomic_dir, fs_failure_line


def tree(folder: Path) -> dict:
    """Every entry under `folder` (links not followed): files' bytes, links' targets, folders."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_file():
                found[rel] = ("file", path.read_bytes())
            else:
                found[rel] = ("dir", None)
    return found


@pytest.fixture(scope="module")
def earlier_run(qs_assets, recipe, tmp_path_factory, datasets_cache) -> Path:  # noqa: F811
    """A finished tiny run with checkpoints at steps 1 and 2 and final/."""
    import datasets
    import torch

    folder = tmp_path_factory.mktemp("earlier") / "run"
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = datasets_cache
    try:
        assert main(["train", recipe, f"output_dir={folder}", "train.max_steps=2", "checkpoint.every_steps=1",
                     "checkpoint.keep_last=0", "eval.every_steps=0"]) == 0
    finally:
        datasets.config.HF_DATASETS_CACHE = saved
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert find_latest(folder / "checkpoints").name == "step-000002"
    return folder


def _steps(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step-*"))


def _latest_gone(run: Path, tmp: Path) -> None:
    for step in _steps(run):
        shutil.rmtree(step)


def _dangling_link(run: Path, tmp: Path) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(tmp / "unmounted-disk" / "checkpoints")


def _a_file(run: Path, tmp: Path) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder\n")


def _all_incomplete(run: Path, tmp: Path) -> None:
    for step in _steps(run):
        (step / "meta.json").unlink()


def _meta_unreadable(run: Path, tmp: Path) -> None:
    for step in _steps(run):
        (step / "meta.json").write_text('{"step": 2, "conf')


def _never_saved(run: Path, tmp: Path) -> None:  # killed before its first checkpoint
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "final")


def _first_save_cut_short(run: Path, tmp: Path) -> None:  # killed during its first checkpoint
    _latest_gone(run, tmp)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / ".tmp-step-000001").mkdir()


BREAKAGES = {  # how a checkpoint can be unusable -> words the refusal must hold
    "latest-names-a-gone-folder": (_latest_gone, "names step-000002, which is gone"),
    "checkpoints-a-dangling-link": (_dangling_link, "unmounted-disk"),
    "checkpoints-a-file": (_a_file, "is not a folder"),
    "every-step-incomplete": (_all_incomplete, "2 step folder(s) incomplete"),
    "meta-json-unreadable": (_meta_unreadable, "unreadable meta.json in step-000001, step-000002"),
    "no-checkpoint-yet": (_never_saved, "there is no checkpoints/ folder"),
    "first-save-cut-short": (_first_save_cut_short, "1 save(s) cut short"),
}


@pytest.mark.parametrize("how", list(BREAKAGES))
def test_resume_auto_without_a_usable_checkpoint_starts_over_and_keeps_the_attempt(capfd, earlier_run, recipe,
                                                                                   tmp_path, how):  # noqa: F811
    """A requeue always continues: with no usable checkpoint, resume=auto starts from step 0 and
    moves what the attempt wrote, byte-identical, into earlier-attempt-N; a second such requeue
    takes the next N and leaves the first alone."""
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run, symlinks=True)
    (run / "tensorboard").mkdir()  # the attempt's tracker logs go with it
    (run / "tensorboard" / "events.out").write_bytes(b"step 1")
    breakage, words = BREAKAGES[how]
    cfg = load_config(recipe, [f"output_dir={run}", "resume=auto"])
    for attempt in (1, 2):
        if attempt == 1:
            breakage(run, tmp_path)
        else:  # the first restart killed before its first checkpoint too
            (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        before = {k: v for k, v in tree(run).items() if not k.startswith("earlier-attempt-")}
        kept = {k: v for k, v in tree(run).items() if k.startswith("earlier-attempt-")}
        try:
            assert prepare_run_dir(cfg, overwrite=False) is None
        finally:
            release_run_dir(run)
        said = capfd.readouterr().out
        assert "starting from step 0" in said and f"earlier-attempt-{attempt}" in said, said
        assert attempt == 2 or words in said, said
        assert tree(run / f"earlier-attempt-{attempt}") == before
        assert {k: v for k, v in tree(run).items() if k.startswith("earlier-attempt-") and
                not k.startswith(f"earlier-attempt-{attempt}")} == kept


def test_latest_gone_falls_back_to_an_older_checkpoint(earlier_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    shutil.rmtree(run / "checkpoints" / "step-000002")
    assert find_latest(run / "checkpoints").name == "step-000001"
    (run / "checkpoints" / "step-000001" / "meta.json").write_text("[]")  # not a checkpoint's meta
    assert find_latest(run / "checkpoints") is None
    assert "unreadable meta.json in step-000001" in why_no_checkpoint(run / "checkpoints")


def test_overwrite_removes_a_link_not_its_target(earlier_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    (run / "notes.txt").write_text("mine\n")
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints").rename(elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    for folder in ("tensorboard", "report"):  # the old run's tracker logs and report: replaced with it
        (run / folder).mkdir()
        (run / folder / "a").write_text("old run\n")
    (run / "generation.json").write_text("{}")
    kept = tree(elsewhere)
    claim_output_dir(run, overwrite=True)
    assert os.listdir(run) == ["notes.txt"] and tree(elsewhere) == kept


# ----------------------------------------------------------------------------- export


def test_export_full_disk_leaves_no_model_folder(capfd, earlier_run, tmp_path):
    """The weights do not fit: one line naming the weights file, and no folder (complete-looking
    or partial) under that name or beside it."""
    with tmpfs(tmp_path / "small", "16k") as small:
        fails(capfd, ["export", str(earlier_run), str(small / "model")], "disk full while writing",
              str(small / "model" / "model.safetensors"))
        assert os.listdir(small) == []


def test_export_refuses_and_fails_in_one_line(capfd, earlier_run, tmp_path):
    (tmp_path / "a-file").write_text("mine\n")
    fails(capfd, ["export", str(earlier_run), str(tmp_path / "a-file" / "model")], "cannot write",
          str(tmp_path / "a-file"), "is a file, not a folder")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    fails(capfd, ["export", str(earlier_run), str(kept)], "not empty")
    assert tree(kept) == {"notes.txt": ("file", b"mine\n")}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(earlier_run), str(empty)]) == 0  # an empty folder is filled
    capfd.readouterr()
    assert (empty / "config.json").is_file() and not list(tmp_path.glob(".*partial*"))


def test_export_checks_cheap_things_first_and_is_one_line(capfd, earlier_run, tmp_path):
    """A bad --push-to-hub id is refused before anything is exported; a damaged DCP .metadata is
    one line, without torch's warnings and tracebacks."""
    fails(capfd, ["export", str(earlier_run), str(tmp_path / "out"), "--push-to-hub", "user/a b"],
          "--push-to-hub", "'user/a b' is not a Hub repo id")
    assert not (tmp_path / "out").exists()
    step = tmp_path / "step"
    shutil.copytree(earlier_run / "checkpoints" / "step-000002", step)
    data = (step / ".metadata").read_bytes()
    (step / ".metadata").write_bytes(data[:len(data) // 2])
    fails(capfd, ["export", str(step), str(tmp_path / "out")], "damaged .metadata", "use another checkpoint")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    # the check stage: a checkpoint whose saved run no longer loads is refused with train's line,
    # before any weight is read or any folder made
    edited = tmp_path / "edited"
    shutil.copytree(earlier_run / "checkpoints" / "step-000002", edited)
    meta = json.loads((edited / "meta.json").read_text())
    meta["config"]["train"]["lr_warmup"] = 3
    (edited / "meta.json").write_text(json.dumps(meta))
    fails(capfd, ["export", str(edited), str(tmp_path / "out")], "train.lr_warmup",
          f"the run config saved in {str(edited / 'meta.json')!r}")
    assert not (tmp_path / "out").exists()
    # a run folder's config.yaml, read by eval and generate: the file is named (not the user's typing)
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run, symlinks=True)
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + "settings: 1\n")
    fails(capfd, ["generate", str(run), "--prompt", "hi", "--max-new-tokens", "1"], "unknown config key 'settings'",
          f"the run config saved in {str(run / 'config.yaml')!r}", "another version or edited")


def test_an_interrupted_export_leaves_no_partial_folder(capfd, earlier_run, monkeypatch, tmp_path):
    """SIGTERM during an export removes its partial folder; one left by a killed export (kill -9:
    its process is gone) is removed by the next."""
    import signal
    import time

    import shardtune.checkpoint.export as export_lib

    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / f".out.partial-{gone.pid}").mkdir()

    def killed(path, hf_config, tokenizer, out, *_):
        (out / "model.safetensors").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs before this ends

    monkeypatch.setattr(export_lib, "export_streamed", killed)
    with pytest.raises(SystemExit) as stopped:
        main(["export", str(earlier_run), str(tmp_path / "out")])
    assert stopped.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    capfd.readouterr()


def test_atomic_dir_keeps_nothing_of_a_failure(tmp_path):
    final = tmp_path / "final"
    with pytest.raises(OSError), atomic_dir(final) as tmp:
        (tmp / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))
    assert os.listdir(tmp_path) == []
    final.mkdir()
    (final / "old.png").write_text("old")
    with atomic_dir(final, replace=True) as tmp:
        (tmp / "new.png").write_text("new")
    assert os.listdir(final) == ["new.png"] and sorted(os.listdir(tmp_path)) == ["final"]


def test_an_output_file_replaces_only_its_own_kind(tmp_path):
    from shardtune.fsio import refuse_foreign_file

    mine, ours = tmp_path / "notes.txt", tmp_path / "out.json"
    mine.write_text("a user's notes")
    ours.write_text('{"made": "by us"}')
    with pytest.raises(UserError, match="not an output; nothing was changed; .* or pass --overwrite"):
        refuse_foreign_file(mine, "--out", "an output", '"made":')
    with pytest.raises(UserError, match="is a folder"):
        refuse_foreign_file(tmp_path, "--out", "an output", '"made":', overwrite=True)
    for path, overwrite in ((ours, False), (mine, True), (tmp_path / "new.json", False)):
        refuse_foreign_file(path, "--out", "an output", '"made":', overwrite)
    assert mine.read_text() == "a user's notes"


def test_train_failing_in_final_leaves_no_final(capfd, monkeypatch, recipe, tmp_path):  # noqa: F811
    """final/ fails half-way (config.json written, then the weights do not go): one line naming
    final/'s file, no final/ (nothing for from_pretrained to take for the model), the checkpoint kept."""
    import shardtune.checkpoint.final as final_mod

    def half(state_dict, hf_config, tokenizer, out, *_, **__):
        (out / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "model.safetensors"))

    monkeypatch.setattr(final_mod, "save_hf_folder", half)
    run = tmp_path / "run"
    fails(capfd, ["train", recipe, f"output_dir={run}", "checkpoint.every_steps=1"], "disk full while writing",
          str(run / "final" / "model.safetensors"))
    assert sorted(os.listdir(run)) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert find_latest(run / "checkpoints").name == "step-000001"


# ----------------------------------------------------------------------------- report, sweep, slurm


def test_report_writes_only_into_a_report_folder(capfd, earlier_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    before = tree(run)
    fails(capfd, ["report", str(run), "--out", str(run)], "report folder", "not a report", "config.yaml")
    assert tree(run) == before
    assert main(["report", str(run)]) == 0 and main(["report", str(run)]) == 0  # its own folder: replaced
    capfd.readouterr()
    assert (run / "report" / "report.md").is_file() and not list(run.glob(".*partial*"))


def test_report_on_a_read_only_disk(capfd, earlier_run, tmp_path):
    ro = tmp_path / "ro"
    with tmpfs(ro, "1m"):
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        fails(capfd, ["report", str(earlier_run), "--out", str(ro / "report")], "cannot write", str(ro),
              "Read-only file system")


def test_sweep_out_refuses_a_run_folder(capfd, earlier_run, recipe, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    before = tree(run)
    fails(capfd, ["sweep", recipe, "--grid", "train.lr=1e-3,2e-3", "--out", str(run), "--steps", "1"],
          "--out", "not a sweep's", "checkpoints")
    assert tree(run) == before


def test_slurm_out_replaces_only_its_own_script(capfd, recipe, tmp_path):
    mine = tmp_path / "job.sh"
    mine.write_text("#!/bin/bash\necho my own job\n")
    argv = ["slurm", recipe, "--nodes", "1", "--gpus-per-node", "1", "-o"]
    fails(capfd, [*argv, str(mine)], "not a script of `shardtune slurm`")
    assert mine.read_text() == "#!/bin/bash\necho my own job\n"
    script = tmp_path / "train.sbatch"
    assert main([*argv, str(script)]) == 0 and main([*argv, str(script)]) == 0
    capfd.readouterr()
    fails(capfd, [*argv, str(mine / "x.sh")], "cannot write", str(mine))


def test_download_cache_under_a_file(capfd, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    (tmp_path / "a-file").write_text("")
    fails(capfd, ["download", "some-org/model", "--cache-dir", str(tmp_path / "a-file" / "cache")],
          "cannot write", str(tmp_path / "a-file"))


# ----------------------------------------------------------------------------- the one handler


def test_fs_failure_line_covers_the_kinds():
    class Wrapped(BaseException):  # as DCP's CheckpointException: each rank's failure in `failures`
        def __init__(self, failures):
            self.failures = failures

    for code, words in [(errno.EACCES, "no permission"), (errno.EROFS, "read-only"), (errno.ENOTDIR, "is a file")]:
        exc = OSError(code, os.strerror(code), "/data/.final.partial-123/model.safetensors")
        for raised in (exc, Wrapped({1: (exc, "traceback")})):
            line = fs_failure_line(raised, "fallback")
            assert line.startswith("cannot write '/data/final/model.safetensors'") and words in line, line
    assert "disk full while writing /x/y" in fs_failure_line(OSError(errno.ENOSPC, "No space left", "/x/y"), "-")
    assert fs_failure_line(PermissionError(errno.EPERM, "Operation not permitted"), "-") is None  # no path: a bug
    assert fs_failure_line(ValueError("bad"), "-") is None


def test_permission_denied_in_any_command_is_one_line(capfd, monkeypatch, earlier_run, tmp_path):
    """Root ignores permissions here, so the refusal is injected where every folder is made."""
    import shardtune.fsio as fsio

    def denied(folder):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))

    monkeypatch.setattr(fsio, "make_dir", denied)
    fails(capfd, ["export", str(earlier_run), str(tmp_path / "locked" / "model")], "cannot write",
          str(tmp_path / "locked"), "Permission denied")
    assert not (tmp_path / "locked").exists()


def test_an_output_dir_inside_another_runs_own_folders_is_refused(capfd, earlier_run, tmp_path):
    """Inside a run's checkpoints/ or final/, a new run would be deleted by that run's --overwrite
    or replaced by its saves: refused in one line, nothing created. A user's own folder that is
    only named final/ (no run beside it) is fine."""
    run = tmp_path / "run"
    shutil.copytree(earlier_run, run)
    before = tree(run)
    for inner in ("checkpoints", "final"):
        for target in (run / inner / "new" / "deeper", run / inner):  # the folder itself too
            with pytest.raises(UserError, match=rf"inside {inner}/ of the run in '{run}'"):
                claim_output_dir(target, overwrite=True)
    assert tree(run) == before
    shutil.rmtree(run / "final")  # a live run that has not saved it yet: an export there raced its save
    # (--merge's OUT inside a run's folders: test_model_inputs.py, with an adapter to merge)
    fails(capfd, ["export", str(earlier_run), str(run / "final")], "export folder",
          "is or lies inside final/ of the run")
    assert not (run / "final").exists()
    mine = tmp_path / "projects" / "final" / "new"
    (tmp_path / "projects" / "config.yaml").parent.mkdir(parents=True)
    (tmp_path / "projects" / "config.yaml").write_text("mine: 1\n")  # no metrics.jsonl: not a run
    claim_output_dir(mine, overwrite=False)
    assert mine.is_dir()
