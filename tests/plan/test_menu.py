"""The planner's menu (plan/menu.py) holds only layouts `train` takes: each candidate, applied to the
recipe as plan's `run it:` line applies it, passes the config's own validation."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY
from shardtune.config.load import load_config
from shardtune.config.validation import validate
from shardtune.errors import UserError
from shardtune.plan.menu import layouts
from shardtune.plan.report import PlanRequest, check_plan
from shardtune.plan.search import variants

RECIPE = {  # key -> values a recipe may set that the menu must respect
    "compile": ["true", "false", "auto"],
    "peft.method": ["none", "lora", "prefix_tuning"],
    "peft.quantize": ["none", "4bit"],
    "precision": ["fp32", "bf16"],
    "activation_offload": ["false", "true"],
    "float8": ["none", "rowwise"],
    "train.optimizer_state": ["fp32", "8bit"],
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in RECIPE.items()}),
       st.sampled_from(["H100", "A100-80GB", "T4"]), st.sampled_from([1, 2]))
def test_every_layout_of_the_menu_is_one_train_takes(recipe, gpu, gpus):
    overrides = [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "train.global_batch_size=8",
                 *(f"{k}={v}" for k, v in recipe.items())]
    try:  # a recipe that train (compile=true with offload...) or plan (float8 on a GPU without it) refuses
        cfg = load_config(None, overrides)
        target, _, _ = check_plan(PlanRequest(gpus=gpus, gpu=gpu), cfg)
    except UserError:
        return
    for layout in layouts(cfg, target):
        for cand in variants(layout, [2], cpu_offload=cfg.peft.quantize == "none"):
            validate(cand.apply(cfg, target))  # a refusal here: plan recommends what train refuses
