"""The memory-saving keys (issue 20): accepted values, the old boolean checkpointing values, and
one-line refusals before any model is built."""

from __future__ import annotations

import json
import re

import pytest

from shardtune.config.load import load_config
from shardtune.errors import UserError

BASE = ["model.config={model_type: gpt2}", "data.path=x"]


@pytest.mark.parametrize("value, kind", [("true", "full"), ("false", "none"), ("full", "full"),
                                         ("selective", "selective"), ("every_n", "every_n"), ("none", "none"),
                                         ("auto", "auto")])
def test_checkpointing_takes_the_kinds_and_the_old_booleans(value, kind):
    assert load_config(None, [*BASE, f"activation_checkpointing={value}"]).activation_checkpointing == kind


def test_old_boolean_checkpointing_loads_from_a_recipe_and_a_saved_config(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("model: {config: {model_type: gpt2}}\ndata: {path: x}\nactivation_checkpointing: true\n")
    assert load_config(recipe).activation_checkpointing == "full"
    # a checkpoint's meta.json holds the config as JSON: loaded as defaults (checkpoint.loading)
    saved = json.loads(json.dumps({**load_config(recipe).to_dict(), "activation_checkpointing": False}))
    assert load_config(None, None, defaults=saved).activation_checkpointing == "none"


def test_micro_batch_size_takes_auto_and_names_both_forms_when_wrong():
    cfg = load_config(None, [*BASE, "train.micro_batch_size=auto", "train.global_batch_size=6"])
    assert cfg.train.micro_batch_size == "auto"
    with pytest.raises(UserError, match=re.escape("must be an integer, got 'big', or one of: auto")):
        load_config(None, [*BASE, "train.micro_batch_size=big"])


@pytest.mark.parametrize("overrides, needle", [
    (["train.optimizer_state=fp8"], "train.optimizer_state='fp8' is not a valid choice"),
    (["activation_checkpointing=partial"], "activation_checkpointing='partial' is not a valid choice"),
    (["activation_checkpointing=every_n", "activation_checkpointing_every=0"],
     "activation_checkpointing_every=0 must be at least 1"),
    (["fsdp.reduce_dtype=fp16"], "fsdp.reduce_dtype='fp16' is not a valid choice"),
    (["fsdp.reduce_dtype=bf16"], "fsdp.reduce_dtype=bf16 needs precision=bf16"),
    (["activation_offload=maybe"], "activation_offload must be true or false"),
    (["activation_offload=true", "compile=true"], "activation_offload does not combine with compile"),
    (["peft.method=lora", "peft.quantize=4bit", "model.name_or_path=m", "device=cuda",
      "activation_checkpointing=selective"], "supports activation_checkpointing=full or none"),
])
def test_bad_memory_saver_settings_are_one_line(overrides, needle):
    with pytest.raises(UserError, match=re.escape(needle)) as err:
        load_config(None, [*BASE, *overrides])
    assert "\n" not in str(err.value)


def test_resume_refuses_another_optimizer_state_but_takes_checkpoints_from_before_the_key(tmp_path):
    from shardtune.checkpoint.folders import check_compatible

    now = load_config(None, [*BASE, "train.optimizer_state=8bit"]).to_dict()
    old = load_config(None, BASE).to_dict()
    with pytest.raises(UserError, match=re.escape("train.optimizer_state 'fp32' -> '8bit' changed")):
        check_compatible(old, now, tmp_path)
    del old["train"]["optimizer_state"]  # a checkpoint written before the key existed: it was fp32
    check_compatible(old, load_config(None, BASE).to_dict(), tmp_path)
