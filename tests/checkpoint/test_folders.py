"""Which checkpoint a `resume=` / `export` spec names, and what a resume may not ask of it (on a
stand-in checkpoint: meta.json and .metadata, no weights; nothing is loaded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtune.checkpoint.folders import resolve_checkpoint, step_of
from shardtune.checkpoint.rundir import prepare_run_dir, release_run_dir
from shardtune.config.load import load_config
from shardtune.errors import UserError


def fake_run(out: Path, steps: tuple[int, ...] = (1, 2)) -> list[str]:
    overrides = ["model.name_or_path=gpt2", f"data.path={out / 'data.jsonl'}", "train.max_steps=2", f"output_dir={out}"]
    config = load_config(None, overrides).to_dict()
    for step in steps:
        folder = out / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step, "config": config}))
        (folder / ".metadata").write_text("")
    (out / "checkpoints" / "latest").write_text(f"step-{steps[-1]:06d}\n")
    (out / "metrics.jsonl").write_text("")
    (out / "config.yaml").write_text("")
    return overrides


@pytest.mark.parametrize("spec", ["", "checkpoints", "checkpoints/latest", "checkpoints/step-000002"])
def test_every_way_to_name_the_newest_checkpoint(tmp_path, spec):
    """`checkpoints/latest` is the pointer file: it was told 'not a complete checkpoint (an
    interrupted save?)', though the run was whole."""
    fake_run(tmp_path)
    assert resolve_checkpoint(tmp_path / spec) == tmp_path / "checkpoints" / "step-000002"


@pytest.mark.parametrize("named", ["{other}/checkpoints/step-000009", "../../other/checkpoints/step-000009"])
def test_latest_names_a_checkpoint_of_its_own_run_only(tmp_path, named):
    """A `latest` edited to hold a path exported (and resumed) another run's checkpoint, silently."""
    fake_run(tmp_path / "run")
    fake_run(tmp_path / "other", steps=(9,))
    (tmp_path / "run" / "checkpoints" / "latest").write_text(named.format(other=tmp_path / "other") + "\n")
    assert resolve_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step-000002"


def test_resuming_past_max_steps_is_refused(tmp_path):
    """train.max_steps below the checkpoint's step trained nothing, saved final/ again and ended 0;
    equal (a finished run requeued) still ends at once."""
    overrides = fake_run(tmp_path)
    files = lambda: sorted(p.name for p in tmp_path.rglob("*") if p.name != ".shardtune.lock")  # noqa: E731
    before = files()
    cfg = load_config(None, [*overrides, "resume=auto", "train.max_steps=1"])
    try:
        with pytest.raises(UserError, match=r"train.max_steps=1 is below the step of the checkpoint it resumes \(2"):
            prepare_run_dir(cfg, overwrite=False)
        assert files() == before  # refused before the folder changed
        cfg = load_config(None, [*overrides, "resume=auto"])
        assert prepare_run_dir(cfg, overwrite=False, check_only=True).endswith("step-000002")
    finally:
        release_run_dir(tmp_path)


@pytest.mark.parametrize("make, said", [
    (lambda p: (p / "final").mkdir(parents=True), "is a run folder without checkpoints; its final/"),
    (lambda p: p.mkdir(), "is not a shardtune checkpoint (no meta.json, no .metadata); give a checkpoint folder"),
    (lambda p: p.write_text("x"), "is a file, not a checkpoint folder; give a checkpoint folder"),
    (lambda p: (p.mkdir(), (p / "meta.json").write_text("{}")), "not a complete shardtune checkpoint"),
])
def test_a_folder_that_is_no_checkpoint_says_what_it_is(tmp_path, make, said):
    """Each was 'not a complete shardtune checkpoint (an interrupted save?)', which only a half-written
    checkpoint is."""
    from shardtune.checkpoint.folders import read_meta

    make(tmp_path / "given")
    with pytest.raises(UserError, match=re.escape(said)):
        read_meta(tmp_path / "given")


@pytest.mark.parametrize("old_copy", [True, False])
def test_a_save_killed_between_its_renames_is_finished_on_restart(tmp_path, old_copy):
    """Killed after meta.json (the save is whole) but before the renames: the restart removed it
    (and the older copy of the same step it was replacing) and resumed from an older checkpoint."""
    overrides = fake_run(tmp_path, steps=(1, 2))
    root = tmp_path / "checkpoints"
    (root / "step-000002").rename(root / ".tmp-step-000004")  # a whole save of step 4, not yet renamed
    meta = json.loads((root / ".tmp-step-000004" / "meta.json").read_text())
    (root / ".tmp-step-000004" / "meta.json").write_text(json.dumps({**meta, "step": 4}))
    if old_copy:  # re-saving step 4 after a resume from an older one: the old copy moved aside first
        (root / ".old-step-000004").mkdir()
    (root / "latest").write_text("step-000001\n")
    try:
        cfg = load_config(None, [*overrides, "resume=auto", "train.max_steps=6"])
        assert prepare_run_dir(cfg, overwrite=False) == str(root / "step-000004")
        assert (root / "latest").read_text() == "step-000004\n"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000004"]
    finally:
        release_run_dir(tmp_path)


@pytest.mark.parametrize("edit", [{"step": 7}, {"train_state": {"step": 5, "tokens_seen": 0.0}}])
def test_a_checkpoint_whose_steps_disagree_is_refused(tmp_path, edit):
    """meta.json's step edited to 7 in step-000002: a resume went on at step 7 from step 2's weights."""
    from shardtune.checkpoint.folders import read_meta

    fake_run(tmp_path)
    folder = tmp_path / "checkpoints" / "step-000002"
    assert read_meta(folder)["step"] == 2
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "format": 2, "train_state": {"step": 2}, **edit}))
    with pytest.raises(UserError, match=r"is inconsistent: its folder name and meta.json give steps 2, [57]"):
        read_meta(folder)


def test_keep_last_after_a_resume_from_an_earlier_checkpoint_keeps_this_runs_own(tmp_path, one_rank):
    """Resumed from step 4 of a run that saved 3, 4, 6, 8, 9 (a new lr, same folder), keep_last=2: the
    new step 8 left only itself and the old 9, a checkpoint of the continuation the resume replaced."""
    from shardtune.checkpoint.dcp import Checkpointer
    from shardtune.config.schema import CheckpointConfig

    fake_run(tmp_path, steps=(3, 4, 6, 8, 9))
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, CheckpointConfig(keep_last=2), tensors=None, states={})
    config = json.loads((root / "step-000004" / "meta.json").read_text())["config"]
    for step, kept in [(6, [4, 6, 8, 9]), (8, [6, 8, 9])]:  # the old 8 and 9 go as the run reaches them
        tmp = root / f".tmp-step-{step:06d}"
        tmp.mkdir()
        (tmp / ".metadata").write_text("")
        ckpt._write_rest(None, tmp, {"step": step, "config": config})
        assert sorted(step_of(p) for p in root.glob("step-*")) == kept
    assert (root / "latest").read_text() == "step-000008\n"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.integers(0, 3), ops=st.lists(st.tuples(st.sampled_from(["save", "rewind"]), st.integers(1, 4)),
                                            min_size=1, max_size=8))
def test_a_requeue_goes_on_from_where_the_run_stands(tmp_path_factory, one_rank, keep, ops):
    """Saves (keep_last=`keep`, replacing an abandoned copy of the same step) and rewinds (resume=PATH of
    any checkpoint of the folder) in any order: resume=auto, and a run folder's newest checkpoint, is the
    checkpoint of the step the run last stood at (the last save, or the checkpoint rewound to). A rewind
    (resume=checkpoints/step-3 of a run that saved 3, 6, 9: back from a loss spike, with a lower lr) killed
    before its first save was requeued from the abandoned step 9 (`latest`), its metrics.jsonl holding
    steps 1-3 and 10 on."""
    from shardtune.checkpoint.dcp import Checkpointer
    from shardtune.config.schema import CheckpointConfig

    out = tmp_path_factory.mktemp("run")
    overrides = [*fake_run(out, steps=(2,)), "train.max_steps=100"]
    root, at = out / "checkpoints", 2
    config = json.loads((root / "step-000002" / "meta.json").read_text())["config"]
    ckpt = Checkpointer(root, CheckpointConfig(keep_last=keep), tensors=None, states={})
    try:
        for op, n in ops:
            if op == "save":
                at += n
                (tmp := root / f".tmp-step-{at:06d}").mkdir()
                (tmp / ".metadata").write_text("")
                ckpt._write_rest(None, tmp, {"step": at, "config": config})
            else:
                saved = sorted(root.glob("step-*"))
                at = step_of(saved[n % len(saved)])
                prepare_run_dir(load_config(None, [*overrides, f"resume={saved[n % len(saved)]}"]), overwrite=False)
            requeue = load_config(None, [*overrides, "resume=auto"])
            assert prepare_run_dir(requeue, overwrite=False, check_only=True) == str(root / f"step-{at:06d}"), ops
            assert resolve_checkpoint(out) == root / f"step-{at:06d}"  # export RUN, eval RUN
    finally:
        release_run_dir(out)
