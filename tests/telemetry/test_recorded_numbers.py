"""The numbers a run records, against what a hand (or torch's FlopCounterMode) counts."""

from __future__ import annotations

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
