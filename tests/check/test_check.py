"""The one check (`check.run`): configs that `train`'s check refuses are refused by `plan`,
`sweep` (before trial 1) and `eval` with the same line, whatever else the config holds; a grid
point is named; the resolved run is frozen (any write raises) and leaves the loaded config as
it was."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import TINY
from shardtune.check.run import check_run
from shardtune.config.load import load_config
from shardtune.errors import UserError
from shardtune.evaluation.evaluate import EvalRequest, check_eval
from shardtune.plan.report import PlanRequest, check_plan
from shardtune.resolve.run import resolve_run
from shardtune.sweep.grid import Sweep
from shardtune.sweep.grid import check as check_sweep
from shardtune.sweep.search import Search
from shardtune.sweep.search import check as check_search
from shardtune.sweep.space import parse_space

# what only the model's structure (its meta skeleton) tells: peft's targets (GPT-2's head is tied to its
# embeddings), the blocks freezing keeps, the block class, size-based units inside selective blocks
STRUCTURE_BREAKERS = {  # what the refusal names: the breaker
    "['nope'] are not modules": {"peft.method": "lora", "peft.target_modules": "[nope]"},
    "lm_head, the LM head, whose weight is tied": {"peft.method": "ia3", "peft.target_modules": "[lm_head]"},
    "freeze.trainable_blocks=3": {"freeze.trainable_blocks": 3},
    "fsdp.block_class='Nope'": {"fsdp.block_class": "Nope"},
    "selective cannot recompute": {"activation_checkpointing": "selective", "fsdp.wrap": "size",
                                   "fsdp.min_num_params": 1}}
# ways to break a run that only the model's config and the tokenizer can tell (TINY gpt2: 128 positions)
BREAKERS = st.one_of(
    st.integers(2, 299).map(lambda v: {"model.config": {**TINY["gpt2"], "vocab_size": v}}),  # tokenizer: 300
    st.integers(129, 100_000).map(lambda n: {"data.seq_len": n}),
    st.integers(1, 10 ** 12).map(lambda v: {"peft.method": "prefix_tuning", "peft.num_virtual_tokens": v}),
    st.integers(1, 10 ** 12).map(lambda v: {"peft.method": "prompt_tuning", "peft.num_virtual_tokens": v}),
    st.just({"peft.method": "adaption_prompt"}),  # not for gpt2
    st.sampled_from(list(STRUCTURE_BREAKERS.values())),
    # a model or tokenizer that is neither a folder here nor a Hub id: no lookup on the Hub names it
    st.tuples(st.sampled_from(["model.tokenizer", "model.name_or_path"]),
              st.sampled_from(["./", "../", "/", "~/", "a/b/", "x y/", "./a/"]),
              st.text("abc-_. ", min_size=1, max_size=8)).map(lambda t: {t[0]: f"{t[1]}{t[2]}-gone"}),
)
NOISE = st.fixed_dictionaries({}, optional={
    "train.lr": st.floats(1e-6, 1e-2), "train.seed": st.integers(0, 2 ** 31), "data.seq_len": st.integers(2, 128),
    "log.every_steps": st.integers(1, 50), "train.global_batch_size": st.sampled_from([8, 16])})


def overrides(assets, settings_: dict) -> list[str]:
    base = {"model.config": TINY["gpt2"], "model.tokenizer": assets["tokenizer"], "data.path": "corpus",
            "train.micro_batch_size": 2, "train.global_batch_size": 8, "device": "cpu"}
    return [f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in {**base, **settings_}.items()]


def as_recipe(words: list[str]) -> dict:
    """The overrides as a recipe's tree: the base a sweep's points and settings change."""
    from shardtune.config.load import parse_override, set_dotted

    tree: dict = {}
    for word in words:
        set_dotted(tree, *parse_override(word))
    return tree


def refusal(check) -> str:
    with pytest.raises(UserError) as exc:
        check()
    return str(exc.value)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(breaker=BREAKERS, noise=NOISE)
def test_what_train_refuses_plan_sweep_and_eval_refuse_with_the_same_line(assets, tmp_path, breaker, noise):
    words = overrides(assets, {**noise, **breaker})
    try:
        cfg = load_config(None, words, defaults={})
    except UserError:
        assume(False)  # refused by the config alone: every command loads it the same way
    try:
        check_run(resolve_run(cfg, 1, say=lambda line: None), 1)
    except UserError as exc:
        refused_everywhere(words, cfg, str(exc))
    else:
        assume(False)


@pytest.mark.parametrize("needle", STRUCTURE_BREAKERS)
def test_what_the_model_structure_refuses_the_check_refuses_for_every_command(assets, needle):
    words = overrides(assets, {"data.seq_len": 64, **STRUCTURE_BREAKERS[needle]})
    cfg = load_config(None, words, defaults={})
    line = refusal(lambda: check_run(resolve_run(cfg, 1, say=lambda line: None), 1))
    assert needle in line, line
    refused_everywhere(words, cfg, line)


def refused_everywhere(words: list[str], cfg, line: str) -> None:
    """plan, sweep (grid and search) and eval refuse `cfg` with train's `line`."""
    assert "\n" not in line
    assert refusal(lambda: check_plan(PlanRequest(gpus=1, gpu="A100-80GB"), cfg)) == line
    sweep = Sweep(None, [], [("train.seed", ["1", "2"])], defaults=as_recipe(words))
    assert refusal(lambda: check_sweep(sweep)) == line
    sweep.grid = []
    assert refusal(lambda: check_search(sweep, Search(parse_space(["train.lr=loguniform:1e-5:1e-3"])))) == line
    from shardtune.model.hf import load_hf_config, load_tokenizer

    assert refusal(lambda: check_eval(EvalRequest(model="run"), cfg, load_hf_config(cfg.model),
                                      load_tokenizer(cfg.model))) == line


def test_a_grid_point_train_would_refuse_is_named_before_trial_1(assets):
    recipe = as_recipe(overrides(assets, {"data.seq_len": 64}))
    sweep = Sweep(None, [], [("data.seq_len", ["64", "512"])], defaults=recipe)
    line = refusal(lambda: check_sweep(sweep))
    assert line.startswith("--grid data.seq_len=512: data.seq_len=512 is above the model's maximum of 128")


def test_the_resolved_run_is_frozen_and_its_source_unchanged(assets, tmp_path):
    cfg = load_config(None, overrides(assets, {"train.micro_batch_size": "auto"}), defaults={})
    run = resolve_run(cfg, 1, say=lambda line: None)
    assert cfg.output_dir is None and cfg.train.micro_batch_size == "auto"  # the loaded config as it was
    assert run.output_dir.startswith("runs/quickstart-") and isinstance(run.train.micro_batch_size, int)
    auto = load_config(None, overrides(assets, {"device": "auto"}), defaults={})
    assert resolve_run(auto, 1).device == ("cuda" if torch.cuda.is_available() else "cpu") and auto.device == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train.micro_batch_size = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.output_dir = str(tmp_path)
    with pytest.raises(ValueError, match="resolved run"):
        check_run(cfg)


def test_train_refuses_before_any_process_group_or_folder(assets, tmp_path, monkeypatch, capsys):
    import shardtune.train.trainer as trainer_lib
    from shardtune.cli.main import main

    def no_group(device):
        raise AssertionError("a process group was started for a run the check refuses")

    monkeypatch.setattr(trainer_lib, "init_distributed", no_group)
    out = tmp_path / "run"
    words = overrides(assets, {"model.config": {**TINY["gpt2"], "vocab_size": 50}, "output_dir": str(out)})
    assert main(["train", *words]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the tokenizer has 300 tokens but the model only 50; use the model's own tokenizer or "
                   "set model.config.vocab_size"] and not out.exists()


@pytest.mark.parametrize("per_node, overrides, refused", [
    ("2(x2),1(x2)", [], True),  # nodes of 2 built a (3, 2) mesh, nodes of 1 a (6, 1) one
    ("3,2,1", [], True),
    ("2(x3)", [], False),
    ("2(x2),1(x2)", ["fsdp.shard_size=3"], False),  # sizes given: every rank builds the same mesh
    ("2(x2),1(x2)", ["fsdp.sharding=full_shard"], False),
])
def test_hybrid_shard_on_uneven_srun_nodes_is_refused_alike_on_every_rank(monkeypatch, capsys, tmp_path,
                                                                          per_node, overrides, refused):
    """srun alone may put different numbers of tasks on its nodes; hybrid_shard's default shard group
    is a node's ranks, so each rank built the mesh of its own node's count and the ranks disagreed
    (some refused, the others waited, or two meshes side by side). Every rank now refuses alike."""
    import os

    from shardtune.check.run import check_node_layout
    from shardtune.cli.main import main

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE")})
    for name, value in {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": per_node,
                        "SLURM_JOB_NODELIST": "127.0.0.1", "PATH": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(None, ["model.name_or_path=gpt2", "data.path=d.jsonl", "fsdp.sharding=hybrid_shard", *overrides])
    if not refused:
        check_node_layout(cfg)
        return
    line = f"different numbers of tasks (SLURM_STEP_TASKS_PER_NODE={per_node})"
    monkeypatch.setenv("SLURM_NODEID", "2")  # a rank on a node of fewer tasks: as refused as rank 0
    with pytest.raises(UserError, match=re.escape(line)):
        check_node_layout(cfg)
    for name, value in {"SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "fsdp.sharding=hybrid_shard", "device=cpu", "train.global_batch_size=6",
                 "train.micro_batch_size=1", f"output_dir={tmp_path / 'out'}"]) == 2
    assert line in capsys.readouterr().err
