"""float8=rowwise|tensorwise: which layers torchao converts, the one-line refusals, and a whole run
(train, checkpoint, exact resume, final/) through torchao's float8 layers. The product refuses
float8 off a GPU of compute capability 8.9+; on the CPU the same float8 matmuls run (their float8
values multiplied in fp32: conftest.lift_float8_device_check), so the in-process runs here lift the
device check and convert the tiny model's layers (torchao's own filter leaves layers this small in
bf16, where float8 is slower)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from conftest import TINY, lift_float8_device_check, losses, tiny_overrides
from shardtune.config.load import load_config
from shardtune.errors import UserError
from shardtune.model import float8

f8 = pytest.importorskip("torchao.float8")

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}


def meta_model(config: dict):
    from shardtune.config.schema import ModelConfig
    from shardtune.distributed.fsdp import detect_block_class
    from shardtune.model.hf import build_meta_model, load_hf_config

    model = build_meta_model(load_hf_config(ModelConfig(config=config)))
    return model, detect_block_class(model)


def test_torchaos_filter_inside_the_decoder_blocks_only():
    """On a ~1B Llama's shapes, rowwise converts only the MLP's up/gate projections (torchao finds
    float8 slower for the 2048-wide ones); tensorwise converts every block linear. The LM head
    (32000 x 2048, which torchao's filter would take) and subclasses with a forward of their own
    stay bf16; parameter names do not change."""

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    every = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for recipe, kinds in [("rowwise", {"gate_proj", "up_proj"}), ("tensorwise", every)]:
        model, block = meta_model(LLAMA_1B)
        model.model.layers[1].mlp.extra = OwnForward(2048, 8192, device="meta")
        names = [n for n, _ in model.named_parameters()]
        assert f8._auto_filter_for_recipe(recipe, [])(model.lm_head, "lm_head")
        assert float8.convert(model, block, recipe) == 2 * len(kinds)
        assert {n.split(".")[-1] for n, m in model.named_modules() if m in float8.converted(model)} == kinds
        assert type(model.lm_head) is nn.Linear and type(model.model.layers[1].mlp.extra) is OwnForward
        assert [n for n, _ in model.named_parameters()] == names
        shapes = float8.matmul_shapes(model)
        assert shapes["float8_matmul"] == sum(m.weight.numel() for m in float8.converted(model))


def test_refused_in_one_line_where_it_cannot_run(monkeypatch):
    tiny = [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "float8=rowwise"]
    for extra, words in [(["precision=fp32"], "set precision=bf16"), (["precision=fp16"], "set precision=bf16"),
                         (["precision=bf16", "peft.method=lora"], "peft.method=lora keeps frozen"),
                         (["precision=bf16", "device=cpu"], "with device=cpu set float8=none")]:
        with pytest.raises(UserError, match=words):
            load_config(None, tiny + extra)
    with pytest.raises(UserError, match="this run is on cpu: set float8=none"):
        float8.check_device("rowwise", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(UserError, match="A100-SXM4-80GB has 8.0: set float8=none"):
        float8.check_device("tensorwise", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    float8.check_device("tensorwise", torch.device("cuda"))  # Ada: allowed
    float8.check_device("none", torch.device("cpu"))


def test_selective_checkpointing_keeps_float8_matmuls():
    from torch.utils.checkpoint import CheckpointPolicy

    from shardtune.distributed.activation_memory import save_matmuls_policy

    assert save_matmuls_policy()(None, torch.ops.aten._scaled_mm.default) == CheckpointPolicy.MUST_SAVE


@pytest.fixture
def float8_on_cpu(monkeypatch):
    lift_float8_device_check(monkeypatch.setattr)


@pytest.fixture(scope="module")
def bf16_losses(assets, tmp_path_factory):
    from conftest import train_tiny

    return train_tiny(assets, tmp_path_factory.mktemp("bf16"), arch="llama", **RUN)


RUN = {"precision": "bf16", "train.max_steps": 6, "eval.at_start": "false", "checkpoint.every_steps": 3,
       "eval.max_batches": 1}


def cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.13's CPU `_scaled_mm` takes a scale per row; 2.11's (the GPU machine's) only one per tensor."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    kernel = getattr(torch._scaled_mm, "kernel", torch._scaled_mm)  # torch's own, not conftest's stand-in
    try:
        kernel(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_float8_run_tracks_bf16_resumes_exactly_and_saves_plain_weights(
        float8_on_cpu, bf16_losses, assets, tmp_path, recipe, capsys):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint.rundir import release_run_dir
    from shardtune.train.trainer import Trainer, run

    if recipe == "rowwise" and not cpu_scaled_mm_takes_row_scales():
        pytest.skip("this torch's CPU _scaled_mm has no row scales (the CUDA one has: tests/e2e/test_cuda.py)")
    torch.set_num_threads(1)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    trainer = Trainer(load_config(None, tiny_overrides(assets, straight, arch="llama", float8=recipe, **RUN)))
    layers = float8.converted(trainer.model)
    assert len(layers) == 2 * 7  # q k v o gate up down in each of the 2 blocks
    gathered_type = type(layers[0].weight.to_local()).__name__
    assert (gathered_type == "WeightWithDynamicFloat8CastTensor") == (recipe == "tensorwise")
    trainer.fit()
    trainer.export()
    trainer.close()
    release_run_dir(str(straight))
    assert f"float8 {recipe}: 14 linear layers" in capsys.readouterr().out
    got = losses(straight)
    # float8 rounds the matmuls: close to bf16, not equal to it
    assert got != bf16_losses
    assert max(abs(a - b) / b for a, b in zip(got, bf16_losses, strict=True)) < 2e-3
    if dist.is_initialized():
        dist.destroy_process_group()
    ckpt = straight / "checkpoints" / "step-000003"
    run(load_config(None, tiny_overrides(assets, resumed, arch="llama", float8=recipe, resume=str(ckpt), **RUN)))
    assert losses(resumed) == got[3:]  # bit for bit: tensorwise's scales are recomputed before the first forward
    final = AutoModelForCausalLM.from_pretrained(straight / "final")
    assert all(type(p.data) is torch.Tensor for p in final.parameters())
    assert type(final.model.layers[0].mlp.up_proj) is nn.Linear


def test_checkpointing_recomputes_float8_layers_exactly(float8_on_cpu, assets, tmp_path):
    """Recomputed in backward (full, every n-th block, or selective, which keeps `_scaled_mm`'s
    outputs), the float8 layers give the very losses of a run that keeps every activation."""
    from conftest import train_tiny

    torch.set_num_threads(1)
    runs = {kind: train_tiny(assets, tmp_path / kind, arch="llama", float8="tensorwise", activation_checkpointing=kind,
                             **{**RUN, "train.max_steps": 3, "checkpoint.every_steps": 0, "save_final": "false"})
            for kind in ("none", "full", "every_n", "selective")}
    assert all(losses_ == runs["none"] for losses_ in runs.values()), runs


def test_the_start_up_line_advises_compile_only_where_it_is_taken():
    """Eager casts: compile=true is the advice, but not with activation offload, which refuses it."""
    line = float8.describe(nn.Linear(16, 16), "rowwise", compiled=False)
    assert "compile=true makes them fast" in line
    offloading = float8.describe(nn.Linear(16, 16), "rowwise", compiled=False, activation_offload=True)
    assert "compile=true" not in offloading and "activation_offload keeps the blocks eager" in offloading
    assert "eager" not in float8.describe(nn.Linear(16, 16), "rowwise", compiled=True)
