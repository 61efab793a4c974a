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

    from shardtune.telemetry.flops import matmul_params

    model = AutoModelForCausalLM.from_config(hf_config("llama", attn_implementation="eager"))
    base = matmul_params(model)[0]
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    total, trainable = matmul_params(lora)
    assert trainable == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert total == base + trainable
    assert forward_weight_flops(lora, 40) == 2 * total * 40


def test_qlora_packed_weights_count_the_values_they_hold():
    """QLoRA's base linears are bitsandbytes Params4bit, two 4-bit values in each byte of their bf16
    storage: numel() is a quarter of the weight. The printed counts are peft's
    get_nb_trainable_parameters, and MFU's matmuls the unpacked model's (both were a quarter)."""
    from archs import hf_config
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.model.hf import count_params
    from shardtune.telemetry.flops import matmul_params

    class Params4bit(torch.nn.Parameter):  # bitsandbytes' class as peft and shardtune tell it: by name
        quant_storage = torch.bfloat16

    model = get_peft_model(AutoModelForCausalLM.from_config(hf_config("llama")), LoraConfig(r=4))
    unpacked = matmul_params(model)
    for name, module in model.named_modules():  # every linear but the adapters' and the head (bitsandbytes' rule)
        if isinstance(module, torch.nn.Linear) and "lora_" not in name and module is not model.get_output_embeddings():
            packed = torch.zeros(module.weight.numel() // 4, 1, dtype=torch.bfloat16)
            module.weight = Params4bit(packed, requires_grad=False)
    assert count_params(model) == tuple(reversed(model.get_nb_trainable_parameters()))
    assert matmul_params(model) == unpacked


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
    from shardtune.telemetry.flops import backward_reach, flops_rates, matmul_params

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


@pytest.mark.parametrize("method", ["prompt_tuning", "prefix_tuning"])
def test_virtual_tokens_count_the_flops_the_model_computes_for_them(method):
    """Prompt tuning's 16 virtual tokens are inputs of every row: 32 data tokens computed as 48 (MFU
    counted 0.63 of the step's matmuls); prefix tuning's are keys of every layer's attention (0.94 of
    the step's). What MFU counts of a step (step.work into the meter) against torch's count of Llama's."""
    from archs import hf_config
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter
    from shardtune.telemetry.flops import backward_reach, flops_rates, matmul_params
    from shardtune.telemetry.metrics import StepClock, StepMeter
    from shardtune.train.step import work

    config = hf_config("llama", attn_implementation="eager")
    model = add_adapter(AutoModelForCausalLM.from_config(config), PeftConfig(method=method, num_virtual_tokens=16))
    ids = torch.randint(2, 300, (2, 32))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                  if str(op) in {"aten.mm", "aten.addmm", "aten.bmm"})
    total, trainable = matmul_params(model)
    meter = StepMeter(1, flops_rates(total, config, 32, trainable, backward_reach(model, LlamaDecoderLayer)), 1.0,
                      StepClock(torch.device("cpu")))
    tokens, pairs, virtual = work(model, [batch])
    meter.add(tokens.item(), pairs.item(), 0.0, 0.0, 1.0, virtual)
    assert meter.report()["mfu"] == counted
