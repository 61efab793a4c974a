"""compile=auto (config/compiling.py): compiled decoder blocks on CUDA, where compile measured 1.34x
eager, and nowhere it does not combine; train resolves it once, before the layout, and says so;
plan prices each layout as train will run it on the GPU."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import TINY
from shardtune.config.compiling import compiles
from shardtune.config.load import load_config

BASE = [f"model.config={json.dumps(TINY['llama'])}", "data.path=unused", "precision=bf16"]


@pytest.mark.parametrize("compile, device, offload, quantize", list(itertools.product(
    [True, False, "auto"], ["cuda", "cpu"], [False, True], ["none", "4bit"])))
def test_auto_compiles_on_cuda_where_it_combines_and_an_explicit_value_stays(compile, device, offload, quantize):
    on = compiles(compile, device, offload, quantize)
    if offload:  # its hooks cannot run inside compiled blocks (compile=true with it is refused at load)
        assert on is False
    elif quantize != "none":  # QLoRA's model is built apart (model.adapters.load_qlora_model) and never compiled
        assert on is False
    elif compile == "auto":
        assert on is (device == "cuda")
    else:
        assert on is compile


def test_the_default_is_auto_and_train_resolves_it_once(monkeypatch):
    import torch

    from shardtune.distributed import process_group
    from shardtune.resolve.run import resolve_run

    cfg = load_config(None, BASE)
    assert cfg.compile == "auto"
    said = []
    assert resolve_run(cfg, 1, say=said.append).compile is False and said == []  # CPU: eager, nothing said
    monkeypatch.setattr(process_group, "resolve_device", lambda name: torch.device("cuda"))
    resolved = resolve_run(cfg, 1, say=said.append)
    assert resolved.compile is True and cfg.compile == "auto"
    assert said == ["compile=auto: each decoder block compiled (1.34x eager measured on an H200; about 15 s of "
                    "compiling first; compile=false to run eager)"]
    assert resolve_run(load_config(None, [*BASE, "activation_offload=true"]), 1, say=said.append).compile is False
    assert resolve_run(load_config(None, [*BASE, "compile=false"]), 1, say=said.append).compile is False
    assert len(said) == 1


def test_a_model_built_from_an_unresolved_config_is_eager():
    """plan's trace and check build from the loaded config: auto there is not a compiled model."""
    from shardtune.model.build import ModelSpec

    assert ModelSpec.of_run(load_config(None, BASE), None).compile is False
    assert ModelSpec.of_run(load_config(None, [*BASE, "compile=true"]), None).compile is True


def test_plan_prices_a_layout_compiled_as_train_will_run_it():
    from types import SimpleNamespace

    from shardtune.hardware import HOST_FACTS, gpu_by_name
    from shardtune.model.hf import build_meta_model, load_hf_config
    from shardtune.plan.cost import Candidate, Target, compiled, step_time
    from shardtune.plan.trace import parameter_counts

    gpu = gpu_by_name("H100")
    target = Target(1, 1, gpu.memory_bytes, gpu)
    cfg = load_config(None, BASE)
    hf_config = load_hf_config(cfg.model)
    trace = SimpleNamespace(params=parameter_counts(build_meta_model(hf_config)), layers=2)
    plain, offloading = Candidate("full_shard", "bf16", 8), Candidate("full_shard", "bf16", 8, activation_offload=True)
    assert compiled(cfg, plain) and not compiled(cfg, offloading)
    assert not compiled(load_config(None, [*BASE, "device=cpu"]), plain)
    eager_cfg = load_config(None, [*BASE, "compile=false"])
    auto = step_time(trace, hf_config, plain, cfg, target, accum=1)["compute"]
    eager = step_time(trace, hf_config, plain, eager_cfg, target, accum=1)["compute"]
    assert eager / auto == pytest.approx(HOST_FACTS["mfu_compiled"].value / HOST_FACTS["mfu"].value, rel=1e-6)
    assert step_time(trace, hf_config, offloading, cfg, target, accum=1)["compute"] == pytest.approx(
        step_time(trace, hf_config, offloading, eager_cfg, target, accum=1)["compute"])


@pytest.mark.parametrize("compile, offload, quantize", list(itertools.product(
    ["true", "false", "auto"], [False, True], ["none", "4bit"])))
def test_train_resolves_compile_as_the_build_runs_it_and_plan_prices_it(monkeypatch, compile, offload, quantize):
    """On a CUDA machine: the resolved run (its config.yaml) says compiled exactly where the build
    compiles (never QLoRA's model, built apart), and plan prices that same layout compiled; an
    explicit compile=true that runs eager is said, not silent, and not refused (a saved config with it loads)."""
    from shardtune.distributed import process_group
    from shardtune.errors import UserError
    from shardtune.plan.cost import Candidate, compiled
    from shardtune.resolve.run import resolve_run

    monkeypatch.setattr(process_group, "resolve_device", lambda name: torch.device("cuda"))
    qlora = ["peft.method=lora", "model.name_or_path=m", "device=cuda"] if quantize != "none" else []
    try:
        cfg = load_config(None, [*BASE, *qlora, f"peft.quantize={quantize}", f"compile={compile}",
                                 f"activation_offload={str(offload).lower()}"])
    except UserError:  # compile=true with offload; QLoRA with offload
        assert offload
        return
    said = []
    resolved = resolve_run(cfg, 1, say=said.append)
    builds_compiled = resolved.compile is True and quantize == "none"  # fsdp.apply_parallelism; QLoRA: no
    assert resolved.compile is builds_compiled
    assert compiled(cfg, Candidate("full_shard", "bf16", 8, activation_offload=offload)) is builds_compiled
    assert len(said) == (compile == "auto" and builds_compiled) + (compile == "true" and not builds_compiled)
