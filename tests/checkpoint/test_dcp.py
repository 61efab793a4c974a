"""checkpoint/dcp.py's Checkpointer in one process: what a load that fails says."""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.errors import UserError


@pytest.mark.parametrize("state, blocks", [("8bit", True), ("fp32", False)])
def test_a_checkpoint_that_does_not_reshard_is_not_called_damaged(one_rank, tmp_path, monkeypatch, state, blocks):
    """A checkpoint of 2 ranks that DCP cannot reshard onto this one (torchao's 8bit moments of a
    300x64 embedding on 2 ranks: shards of 150 rows cut its 256-value blocks, and dcp.load fails
    in torchao) is one line naming both world sizes and the way out (resume on 2 ranks); it said
    "damaged or from another model: use another checkpoint", and every checkpoint of the run was so."""
    import torch.distributed.checkpoint as dcp

    from shardtune.checkpoint.dcp import Checkpointer, ModelOptimizerState
    from shardtune.config.schema import CheckpointConfig, RunConfig, TrainConfig

    model = torch.nn.Linear(4, 4)
    config = RunConfig(train=TrainConfig(optimizer_state=state)).to_dict()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(), ModelOptimizerState(model, torch.optim.AdamW(model.parameters())),
                        {}, describe=lambda step: {"config": config})
    folder = ckpt.save(3)
    ckpt.load(folder)  # the same world size: loads
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))

    def torchao_fails(*args, **kwargs):
        raise ValueError("Invalid start or end for shape=torch.Size([300, 64]) and block_size=256. Make sure start "
                         "and end align with block boundary. Received start=0, end=150.")

    monkeypatch.setattr(dcp, "load", torchao_fails)
    with pytest.raises(UserError) as err:
        ckpt.load(folder)
    line = str(err.value)
    assert "\n" not in line and "damaged" not in line
    assert "written by 2 rank(s), could not be resharded onto 1 (ValueError: Invalid start" in line
    assert line.endswith("resume it on 2 rank(s) (--nproc 2)")
    assert ("optimizer_state=8bit moments are quantized in blocks" in line) is blocks


@pytest.mark.parametrize("async_save", [False, True])
def test_every_file_of_a_checkpoint_is_on_disk_before_its_meta_json(one_rank, tmp_path, monkeypatch, async_save):
    """meta.json (fsynced) marks a checkpoint complete, and resume=auto takes the newest so marked; the RNG
    states (torch.save) and the config and tokenizer beside the shards were never fsynced: a machine that
    lost power after a save could keep a checkpoint that says it is whole with an empty rng-rank00000.pt,
    which every requeue then refused as damaged ("use another checkpoint") instead of resuming."""
    import os

    import shardtune.checkpoint.dcp as dcp_mod
    from shardtune.checkpoint.dcp import Checkpointer, ModelOptimizerState
    from shardtune.config.schema import CheckpointConfig, RunConfig

    synced, real_fsync, real_write = set(), os.fsync, dcp_mod.write_text_atomic

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    def write(path, text, sync=False):
        if path.name == "meta.json":
            files = [p for p in path.parent.rglob("*") if p.is_file()]
            assert {p.name for p in files} >= {".metadata", "rng-rank00000.pt", "config.json", "vocab.txt"}
            assert [p.name for p in files if p.stat().st_ino not in synced] == []
        real_write(path, text, sync)

    def extras(folder):  # as the trainer's: the HF config, and a tokenizer in a subfolder
        (folder / "config.json").write_text("{}")
        (folder / "tokenizer").mkdir()
        (folder / "tokenizer" / "vocab.txt").write_text("a\nb\n")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(dcp_mod, "write_text_atomic", write)
    model = torch.nn.Linear(4, 4)
    config = RunConfig().to_dict()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=async_save),
                        ModelOptimizerState(model, torch.optim.AdamW(model.parameters())), {},
                        describe=lambda step: {"config": config}, write_extras=extras)
    try:
        folder = ckpt.save(3)
        ckpt.wait()
    finally:
        ckpt.close()
    assert (folder / "meta.json").is_file()
