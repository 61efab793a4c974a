"""The one build (build.build_model) and the one sharding policy (parallel.reshard_after_forward)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import TINY
from shardtune.build import ModelSpec, build_model
from shardtune.config import FSDPConfig, PeftConfig
from shardtune.launch import init_distributed
from shardtune.parallel import build_mesh, reshard_after_forward


@pytest.mark.parametrize("sharding,group,expected", [
    ("full_shard", 4, True), ("hybrid_shard", 2, True),
    ("full_shard", 1, False), ("hybrid_shard", 1, False),  # a shard group of one: nothing to free
    ("shard_grad_op", 4, False), ("no_shard", 1, False)])
def test_one_policy_decides_resharding_and_gradient_sync(sharding, group, expected):
    assert reshard_after_forward(sharding, group) is expected


@pytest.fixture
def one_rank():
    d = init_distributed("cpu")
    yield d
    dist.destroy_process_group()


def hf_config(arch: str):
    from transformers import AutoConfig

    cfg = dict(TINY[arch])
    return AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg)


@pytest.mark.parametrize("arch,block", [("gpt2", "GPT2Block"), ("opt", "OPTDecoderLayer"),
                                        ("llama", "LlamaDecoderLayer")])
def test_without_a_source_the_sharded_skeleton_stays_on_meta(one_rank, arch, block):
    spec = ModelSpec(hf_config(arch))
    built = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device)
    assert built.block_cls.__name__ == block and len(built.units) == 2
    assert all(p.is_meta for p in built.model.parameters())
    assert not built.sync_grads_each_micro_step  # one rank: gradients reduced once per step


def test_a_source_fills_the_weights_and_adapters_match(one_rank):
    from transformers import AutoModelForCausalLM

    spec = ModelSpec(hf_config("gpt2"), peft=PeftConfig(method="lora"), fsdp=FSDPConfig(sharding="no_shard"))
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(spec.hf_config)
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    built = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device, source=lambda: plain, seed=3)
    state = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v.full_tensor()
             for k, v in built.model.state_dict().items() if "lora_" not in k}
    assert set(reference) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
