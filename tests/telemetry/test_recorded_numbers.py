"""The numbers a run records, against what a hand (or torch's FlopCounterMode) counts."""

from __future__ import annotations

import pytest
import torch


def forward_weight_flops(model, tokens: int) -> int:
    """The forward's FLOPs of weight matmuls as torch counts them (attention's bmm aside)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(2, 300, (1, tokens)), use_cache=False)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)


def test_an_adapted_layer_counts_its_base_weight_once():
    """peft's lora.Linear answers `weight` with its base layer's: counted there, not again."""
    from archs import hf_config
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.telemetry.metrics import matmul_params

    model = AutoModelForCausalLM.from_config(hf_config("llama", attn_implementation="eager"))
    base = matmul_params(model)[0]
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    total, trainable = matmul_params(lora)
    assert trainable == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert total == base + trainable
    assert forward_weight_flops(lora, 40) == 2 * total * 40


@pytest.mark.parametrize("freeze", [{"trainable_blocks": 1}, {"head_only": True}, {}])
def test_a_frozen_models_flops_are_the_matmuls_its_step_runs(freeze):
    """Backward stops below the first parameter that trains: frozen blocks under it run their
    forward only. The rates MFU uses give the matmuls (weights' and attention's) that torch counts
    in one forward and backward of an untied GPT-2 of 2 blocks."""
    from archs import hf_config
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from shardtune.config.schema import FreezeConfig
    from shardtune.model.adapters import freeze as freeze_model
    from shardtune.telemetry.metrics import backward_reach, flops_rates, matmul_params

    config = hf_config("gpt2", attn_implementation="eager", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    freeze_model(model, FreezeConfig(**freeze), GPT2Block)
    tokens = 32
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(2, 300, (1, tokens)), labels=torch.randint(2, 300, (1, tokens))).loss.backward()
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                  if str(op) in {"aten.mm", "aten.addmm", "aten.bmm"})
    total, trainable = matmul_params(model)
    per_token, per_pair = flops_rates(total, config, tokens, trainable, backward_reach(model, GPT2Block))
    assert per_token * tokens + per_pair * tokens**2 == counted
