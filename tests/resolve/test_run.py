"""resolve_run's values handed on (resolve/run.py `handed_on`): a rank of `train --nproc N`, given
the parent's recipe and overrides and those words, resolves the same run and resolves nothing again."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY
from shardtune.config.load import load_config
from shardtune.distributed import process_group
from shardtune.resolve.run import handed_on, resolve_run

BASE = [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "train.global_batch_size=8",
        "train.micro_batch_size=2"]


def again(overrides: list[str]) -> tuple[dict, list[str]]:
    """(the resolved run, what it said) of the parent, checked against a rank's resolution."""
    said: list[str] = []
    parent = resolve_run(load_config(None, overrides), 2, say=said.append)
    rank_said: list[str] = []
    rank = resolve_run(load_config(None, [*overrides, *handed_on(parent)]), 2, say=rank_said.append)
    assert rank.to_dict() == parent.to_dict()
    assert rank_said == []  # the parent said what auto chose; a rank says it again only if it resolved again
    return parent.to_dict(), said


@pytest.mark.parametrize("extra", [[], ["compile=false"], ["compile=true"], ["activation_offload=true"],
                                   ["output_dir=runs/exp #2"], ["device=cpu"]])
def test_a_rank_resolves_what_the_parent_resolved(monkeypatch, extra):
    from shardtune.plan import fit

    monkeypatch.setattr(process_group, "resolve_device", lambda name: torch.device("cuda"))  # a CUDA machine
    monkeypatch.setattr(fit, "resolve_layout", lambda cfg, *a, **k: (4, "selective", "the planner's line"))
    resolved, said = again([*BASE, "precision=bf16", "train.micro_batch_size=auto", "activation_checkpointing=auto",
                            *extra])
    assert (resolved["train"]["micro_batch_size"], resolved["activation_checkpointing"]) == (4, "selective")
    assert resolved["compile"] is (extra in ([], ["output_dir=runs/exp #2"], ["compile=true"]))
    compiled_line = resolved["compile"] and "compile=true" not in extra
    assert len(said) == 1 + compiled_line
