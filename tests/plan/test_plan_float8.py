"""plan prices float8: its memory from the trace of the converted model (tensorwise gathers one
byte per converted weight), its time from the converted layers' FLOPs at the float8 peak and their
casts, calibrated to torchao's published gains; a GPU without float8 units is refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardtune.config.load import load_config
from shardtune.errors import UserError
from shardtune.hardware import gpu_by_name
from shardtune.model import float8
from shardtune.plan.cost import Candidate, Target, step_time
from shardtune.plan.trace import StepTrace, trace_step

pytest.importorskip("torchao.float8")

# Llama-3-8B's public shapes (meta-llama/Meta-Llama-3-8B config.json)
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192}


def cfg_of(model: dict, *extra: str):
    return load_config(None, [f"model.config={json.dumps(model)}", "data.path=unused", "precision=bf16", *extra])


def counted(cfg) -> StepTrace:
    """What step_time reads of a trace, counted on the meta model (no activations: time only)."""
    from shardtune.distributed.fsdp import detect_block_class
    from shardtune.model.hf import build_meta_model, count_params, load_hf_config
    from shardtune.telemetry.flops import matmul_params

    model = build_meta_model(load_hf_config(cfg.model))
    float8.convert(model, detect_block_class(model), cfg.float8)
    total, trainable = count_params(model)
    matmul, matmul_trainable = matmul_params(model)
    return StepTrace({}, 32, {}, {"total": total, "trainable": trainable, "matmul": matmul,
                                  "matmul_trainable": matmul_trainable, **float8.matmul_shapes(model)})


def test_the_time_model_gives_torchaos_published_gains():
    """Llama-3-8B on 8 x H100, seq 8192, compiled: torchao publishes +10 % tokens/s for rowwise
    and +25 % for tensorwise with float8 all-gather; the planner's model is set to match (until
    bench/gpu/run.sh's float8 stage measures it), and eager casts cost more than compiled ones."""
    from shardtune.model.hf import load_hf_config

    target = Target(8, 1, 80 * 2**30, gpu_by_name("H100"))
    cand = Candidate("full_shard", "bf16", 1)

    def seconds(recipe: str, compiled: bool = True) -> dict:
        cfg = cfg_of(LLAMA3_8B, "data.seq_len=8192", f"float8={recipe}", f"compile={str(compiled).lower()}",
                     "train.micro_batch_size=1", "train.global_batch_size=8")
        return step_time(counted(cfg), load_hf_config(cfg.model), cand, cfg, target, accum=1)

    bf16, rowwise, tensorwise = seconds("none"), seconds("rowwise"), seconds("tensorwise")
    assert bf16["total"] / rowwise["total"] == pytest.approx(1.10, abs=0.01)
    assert bf16["total"] / tensorwise["total"] == pytest.approx(1.25, abs=0.01)
    assert tensorwise["communication"] < rowwise["communication"] == bf16["communication"]
    assert seconds("rowwise", compiled=False)["compute"] > rowwise["compute"]


def test_tensorwise_gathers_float8_weights_in_the_trace(monkeypatch):
    """Two fake ranks, a model whose block linears torchao converts: the gathered parameters at
    the peak shrink with tensorwise (one byte per converted weight instead of two)."""
    from shardtune.model.hf import load_hf_config

    shape = {**LLAMA3_8B, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
             "num_attention_heads": 8, "vocab_size": 1024}

    def gathered(recipe: str) -> tuple[int, dict]:
        cfg = cfg_of(shape, "data.seq_len=64", f"float8={recipe}", "train.micro_batch_size=1",
                     "train.global_batch_size=2")
        trace = trace_step(cfg, load_hf_config(cfg.model), world_size=2, target="cuda")
        return max(p.get("gathered_params", 0) for p in trace.phases.values()), trace.params

    none, none_params = gathered("none")
    tensorwise, params = gathered("tensorwise")
    assert none_params.get("float8_matmul", 0) == 0 < params["float8_matmul"]
    assert tensorwise < none


def test_a_gpu_without_float8_units_is_refused_before_any_trace():
    from shardtune.plan.report import PlanRequest, run_plan

    cfg = cfg_of(LLAMA3_8B, "float8=rowwise")
    with pytest.raises(UserError, match="A100-80GB has none: set float8=none"):
        run_plan(PlanRequest(gpus=8, gpu="A100-80GB"), cfg, None, [])


def test_plan_tells_what_float8_would_give_where_the_card_has_it():
    """A recipe without float8, planned for H100s: the answer names both recipes with their predicted
    speed for the winning layout (compiled; eager where the layout offloads activations); none on
    a card without float8 units, none when the recipe already sets it."""
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.cost import step_time
    from shardtune.plan.report import float8_alternatives
    from shardtune.plan.search import Estimate

    cfg = cfg_of(LLAMA3_8B, "data.seq_len=8192", "train.micro_batch_size=1", "train.global_batch_size=8")
    hf_config = load_hf_config(cfg.model)
    h100, a100 = (Target(8, 1, 80 * 2**30, gpu_by_name(name)) for name in ("H100", "A100-80GB"))

    def best(cand: Candidate, target: Target) -> Estimate:
        # the time from the meta model's counts; the memory from a step of 16 GiB of kept states and 8 of buffers
        states = {"sharded_params": 4 * 2**30, "gradients": 4 * 2**30, "optimizer_state": 8 * 2**30}
        trace = dataclasses.replace(counted(cfg), phases={(1, "forward", "after blocks"): {**states,
                                                                                            "activations": 8 * 2**30}})
        seconds = step_time(trace, hf_config, cand, cfg, target, accum=1)["total"]
        return Estimate(cand, {}, {}, seconds, 8 * 8192 / seconds, 1, True, trace=trace)

    plain = best(Candidate("full_shard", "bf16", 1), h100)
    alts = {a["recipe"]: a for a in float8_alternatives(cfg, hf_config, h100, plain)}
    assert alts["tensorwise"]["tokens_per_s"] > alts["rowwise"]["tokens_per_s"] > plain.tokens_per_s
    assert alts["rowwise"]["layers"] == 32 * 5 and alts["rowwise"]["compile"]  # k, v (1024 wide) stay bf16
    offloading = best(Candidate("full_shard", "bf16", 1, activation_offload=True), h100)
    assert not any(a["compile"] for a in float8_alternatives(cfg, hf_config, h100, offloading))
    assert float8_alternatives(cfg, hf_config, a100, best(Candidate("full_shard", "bf16", 1), a100)) == []
    assert float8_alternatives(cfg_of(LLAMA3_8B, "float8=rowwise"), hf_config, h100, plain) == []

    # float8's casts keep buffers cached of their own (H200: reserved 2.4x the step's transient bytes
    # over allocated against 0.5x): on a card where the bf16 layout fits and float8's would not, the
    # alternative says so rather than promising its speed
    from shardtune.plan.cost import gpu_memory
    from shardtune.plan.report import float8_line

    bf16 = gpu_memory(plain.trace, False, 8, plain.candidate.technique(cfg))["total"]
    assert all(a["fits"] and a["memory_total"] > bf16 for a in alts.values())
    between = (bf16 + min(a["memory_total"] for a in alts.values())) / 2
    tight = Target(8, 1, int(between / (1 - h100.margin)), gpu_by_name("H100"))
    squeezed = float8_alternatives(cfg, hf_config, tight, plain)
    assert squeezed and not any(a["fits"] for a in squeezed)
    line = float8_line(squeezed[0], {"gpu_memory_bytes": tight.memory_bytes, "margin": tight.margin})
    assert line.startswith(f"  with float8={squeezed[0]['recipe']} compile=true: does not fit this layout (needs ")
    assert "tokens/s" not in line


def test_the_answer_shows_the_float8_lines(monkeypatch, capsys):
    """Through `plan`'s own answer (H100, a recipe without float8): one line per recipe, after the
    command to run. The tiny model's layers are converted as in tests/model/test_float8.py."""
    from conftest import TINY, lift_float8_device_check
    from shardtune.plan.report import PlanRequest, run_plan

    lift_float8_device_check(monkeypatch.setattr)
    cfg = cfg_of(TINY["llama"], "data.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8")
    assert run_plan(PlanRequest(gpus=1, gpu="H100"), cfg, None, []) == 0
    out = capsys.readouterr().out
    after = out.split("run it:")[1]
    for recipe in float8.RECIPES:
        assert f"with float8={recipe} compile=true (14 linear layers in float8; " in after, out
