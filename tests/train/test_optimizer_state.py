"""train.optimizer_state: torchao's low-precision AdamW moments: their size, an exact resume, and a
plain exported model. torchao compiles its per-parameter step; on 2 CPU cores that costs a minute
for a tiny model, so these tests run the same step function eagerly (torch.compile -> identity)."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.schema import TrainConfig
from shardtune.train.optim import build_optimizer, optimizer_state_bytes, set_lr

pytest.importorskip("torchao")


@pytest.fixture
def eager_torchao(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)


@pytest.mark.parametrize("state, per_param", [("fp32", 8.0), ("bf16", 4.0), ("8bit", 2.0), ("4bit", 1.0)])
def test_moment_bytes_per_parameter(eager_torchao, state, per_param):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 65,536-value weight (quantized), 256-value bias (kept fp32)
    opt = build_optimizer(model, TrainConfig(optimizer_state=state, weight_decay=0.1), torch.device("cpu"))
    before = model.weight.detach().clone()
    model(torch.randn(4, 256)).square().mean().backward()
    set_lr(opt, 1e-2)
    opt.step()
    assert not torch.equal(before, model.weight)
    bias_bytes = 2 * 256 * 4
    weight_bytes = optimizer_state_bytes(opt) - bias_bytes - 4 * (2 if state == "fp32" else 1)  # step counters
    # block scales (one fp32 per 256 values for 8bit, 128 for 4bit) and the code tables on top
    assert per_param <= weight_bytes / model.weight.numel() <= per_param * 1.07


def test_low_precision_states_resume_exactly_and_export_a_plain_model(eager_torchao, assets, tmp_path, capsys):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from conftest import losses, tiny_overrides
    from shardtune.cli.main import main
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    torch.set_num_threads(1)
    quiet = {"train.optimizer_state": "8bit", "eval.at_start": "false", "train.max_steps": 4,
             "checkpoint.every_steps": 2}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(load_config(None, tiny_overrides(assets, straight, **quiet)))
    ckpt = straight / "checkpoints" / "step-000002"
    run(load_config(None, tiny_overrides(assets, resumed, **{**quiet, "resume": str(ckpt)})))
    assert losses(resumed) == losses(straight)[2:]  # bit for bit
    if dist.is_initialized():
        dist.destroy_process_group()
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    names = set(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict())
    assert names == set(AutoModelForCausalLM.from_pretrained(straight / "final").state_dict())


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_compiled_step_skips_the_cross_rank_autograd_cache(monkeypatch, state):
    """torch's on-disk AOTAutograd cache, shared by a host's ranks, keys a DTensor by its global
    shape: with shards the ranks do not divide evenly (GPT-2's 50257-row vocabulary on 2 ranks) a
    rank loaded another's step and failed ("expected size 25129==25128"). The step compiles
    without that cache (inductor's cache, keyed by local shapes, stays on)."""
    import torch._functorch.config as functorch_config

    seen = []

    def compile_recording(fn, **kw):
        seen.append(functorch_config.enable_autograd_cache)
        return fn

    monkeypatch.setattr(torch, "compile", compile_recording)
    model = torch.nn.Linear(64, 64)
    opt = build_optimizer(model, TrainConfig(optimizer_state=state), torch.device("cpu"))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert seen and not any(seen)
    assert functorch_config.enable_autograd_cache  # restored after the step


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit", "4bit"])
def test_a_resume_keeps_the_moments_as_the_straight_run_has_them(eager_torchao, one_rank, tmp_path, state):
    """A checkpoint's optimizer loaded back (DCP, as Checkpointer.load does) holds its moments in the
    same kinds and bytes as the run that saved it, and the next updates are bit for bit the same.
    torch's load_state_dict cast bf16 moments to the parameters' fp32: twice the memory, and from the
    second update after the resume other roundings (the first reads the moments in fp32 either way)."""
    import torch.distributed.checkpoint as dcp

    from shardtune.checkpoint.dcp import ModelOptimizerState

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 4))  # 8192 values: low-precision
        return model, build_optimizer(model, TrainConfig(optimizer_state=state), torch.device("cpu"))

    def steps(model, opt, n):
        for i in range(n):
            model(torch.randn(4, 128, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            set_lr(opt, 1e-2)
            opt.step()
            opt.zero_grad()

    def kinds(opt):
        return [(type(v).__name__, v.dtype) for s in opt.state.values() for v in s.values()]

    straight, opt = build()
    steps(straight, opt, 2)
    saved = ModelOptimizerState(straight, opt)
    dcp.save(saved.state_dict(), checkpoint_id=tmp_path)
    resumed, opt2 = build()
    loaded = ModelOptimizerState(resumed, opt2)
    tensors = loaded.state_dict()
    dcp.load(tensors, checkpoint_id=tmp_path)
    loaded.load_state_dict(tensors)
    assert kinds(opt2) == kinds(opt)
    assert optimizer_state_bytes(opt2) == optimizer_state_bytes(opt)
    steps(straight, opt, 3)
    steps(resumed, opt2, 3)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
