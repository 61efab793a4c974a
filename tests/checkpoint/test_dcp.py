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
