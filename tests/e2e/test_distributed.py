"""The proof FSDP is right: sharded runs compute the same per-step losses as one process.

Multi-process launches are slow on 2 cores, so each launch runs several jobs (dist_harness.py).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from archs import arch_config
from plan_measured import MEASURED, OVER, UNDER, traced_error

from conftest import (
    PEFT_METHODS,
    ROOT,
    TINY,
    child_env,
    lift_float8_device_check,
    losses,
    peft_overrides,
    run_cli,
    tiny_overrides,
)

pytestmark = pytest.mark.multiproc
TOL = 1e-5


@pytest.fixture(scope="module")
def baseline_dir(assets, tmp_path_factory):
    """Single-process reference run (accumulation 4), in this process: its folder."""
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("baseline")
    run(load_config(None, tiny_overrides(assets, out, **WATCH), defaults={}), overwrite=True)
    return out


@pytest.fixture(scope="module")
def baseline(baseline_dir):
    return losses(baseline_dir)


# log.watch's per-block norms from the shards equal the unsharded ones (the baseline watches too)
WATCH = {"log.watch": "all", "log.watch_every": 3}


def watched(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[k] for r in rows for k in sorted(r) if k.startswith(("grad_norm/", "param_norm/"))]


def grad_norms(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


def same_watch(out, baseline_dir, tol: float = 1e-5) -> None:
    got, want = watched(out), watched(baseline_dir)
    assert len(want) == 2 * 2 * 4  # 2 watched steps x (grad, param) x (embeddings, h.0, h.1, head)
    assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, want, strict=True)) <= tol, (got, want)


LORA = {"peft.method": "lora", "peft.dropout": 0.0}


@pytest.fixture(scope="module")
def lora_baseline(assets, tmp_path_factory):
    """Single-process LoRA reference run, in this process."""
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("lora_baseline")
    run(load_config(None, tiny_overrides(assets, out, **LORA), defaults={}), overwrite=True)
    return losses(out)


DOCMASK = {"data.document_mask": "true"}


@pytest.fixture(scope="module")
def docmask_baseline(assets, tmp_path_factory):
    """Single-process reference run of document-masked packed blocks, in this process."""
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("docmask_baseline")
    run(load_config(None, tiny_overrides(assets, out, **DOCMASK), defaults={}), overwrite=True)
    return losses(out)


# Mixtral with the router's load-balancing loss on: each micro-batch's term weighted by its tokens
MOE = {"model.config": json.dumps(arch_config("mixtral"))}


@pytest.fixture(scope="module")
def moe_baseline(assets, tmp_path_factory):
    """Single-process reference run of a mixture of experts with its router loss, in this process."""
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("moe_baseline")
    run(load_config(None, tiny_overrides(assets, out, **MOE), defaults={}), overwrite=True)
    return losses(out)


# float8 tensorwise (its weights all-gathered in float8) on the CPU: conftest.lift_float8_device_check
FLOAT8 = {"model.config": json.dumps(TINY["llama"]), "precision": "bf16", "float8": "tensorwise"}


@pytest.fixture(scope="module")
def float8_baseline(assets, tmp_path_factory):
    """Single-process float8 reference run, in this process."""
    pytest.importorskip("torchao.float8")
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("float8_baseline")
    with pytest.MonkeyPatch.context() as patch:
        lift_float8_device_check(patch.setattr)
        run(load_config(None, tiny_overrides(assets, out, **FLOAT8), defaults={}), overwrite=True)
    return losses(out)


def torchrun(nproc: int, script_args: list[str], nnodes: int = 1, timeout: int = 400):
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1:
        cmd.append("--standalone")
        return subprocess.run(cmd + script_args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd += [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=st"]
    agents = [subprocess.Popen(cmd + [f"--node_rank={i}", *script_args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT) for i in range(nnodes)]
    outs = [a.communicate(timeout=timeout)[0] for a in agents]
    return [(a.returncode, o) for a, o in zip(agents, outs, strict=True)]


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_two_ranks_match_one_process_for_every_sharding(assets, baseline, baseline_dir, lora_baseline,
                                                        docmask_baseline, moe_baseline, float8_baseline, peft_runs,
                                                        tmp_path):
    """full_shard (accumulation 2 and 1, activation checkpointing full and selective with offloading),
    shard_grad_op and no_shard
    on 2 ranks, with full logits and with many loss chunks (the baseline's loss is one chunk),
    and document-masked packing, and Mixtral with its router loss (accumulation 2 against 4), and
    float8 tensorwise with its float8 all-gather (on CPU, conftest.lift_float8_device_check);
    each peft method (DoRA with rsLoRA, PiSSA with LoRA+, OLoRA, IA3, adaption prompt, prefix and
    prompt tuning);
    the planner's traced peak agrees with the step really run on 2 ranks where gloo's own copies
    decide the peak (tests/plan_measured.py);
    the logged peak memory is the fullest rank's;
    a locally saved GPT-2 and Llama load on 2 ranks exactly (rank 0's broadcast and model.sharded_load)
    and, written back by both ranks (checkpoint.sharded_final), load bitwise equal; final/ round-trips
    (job 0 writes it sharded); a checkpoint.hf_format checkpoint resumes on 2 ranks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY

    saved = []
    for arch in ("gpt2", "llama"):
        cfg = dict(TINY[arch])
        config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg)
        folder = tmp_path / f"saved-{arch}"
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        saved.append(str(folder))
    jobs = {
        # + a step-3 checkpoint with the model in HF safetensors, written by both ranks ...
        "full_shard": {**WATCH, "checkpoint.sharded_final": "true", "checkpoint.every_steps": 3,
                       "checkpoint.hf_format": "true"},
        "full_shard_ac": {"activation_checkpointing": "true"},
        "selective_ac_offload": {"activation_checkpointing": "selective", "activation_offload": "true"},
        "shard_grad_op": {"fsdp.sharding": "shard_grad_op"},
        "no_shard": {"fsdp.sharding": "no_shard", "loss_chunk_tokens": 0, **WATCH},  # full logits; replicated
        "no_accum": {"train.micro_batch_size": 4, "loss_chunk_tokens": 24},  # 11 loss chunks per micro-batch
        "size_wrap": {"fsdp.wrap": "size", "fsdp.min_num_params": 20000, "fsdp.forward_prefetch": 1},
        "lora": LORA,
        "docmask": DOCMASK,
        "moe": MOE,
        "float8": FLOAT8,
        # ... which both ranks resume from, reading their rows of it (steps 4-6 as the baseline's)
        "hf_resume": {"resume": str(tmp_path / "full_shard" / "checkpoints" / "step-000003")},
    }
    spec = {"result": str(tmp_path / "result.json"), "load": saved, "export": True, "float8_on_cpu": True,
            "rank_memory": True,
            "measure": MEASURED,
            "jobs": [tiny_overrides(assets, tmp_path / name, **extra) for name, extra in jobs.items()]
            + [peft_overrides(assets, tmp_path / name, name) for name in PEFT_METHODS]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = torchrun(2, ["tests/dist_harness.py", str(tmp_path / "spec.json")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert all(diff == 0.0 for diff in result["loading"].values()), result["loading"]
    assert result["export_logit_diff"] < 1e-5
    assert len(baseline) == 6
    for name in jobs:
        got, want = losses(tmp_path / name), {"lora": lora_baseline, "docmask": docmask_baseline,
                                          "moe": moe_baseline, "float8": float8_baseline,
                                          "hf_resume": baseline[3:]}.get(name, baseline)
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL, (name, got, want)
    for name, run in peft_runs.items():  # the 1-process runs of tests/model/test_peft_methods.py
        got, want = losses(tmp_path / name), run["losses"]
        assert len(got) == len(want) == 3
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL, (name, got, want)
    for name in ("full_shard", "no_shard"):
        same_watch(tmp_path / name, baseline_dir)
    # the logged gradient norm (clipped at 1.0 every step here) is the one process's, over both ranks'
    # shards: AdamW's update hardly moves with a uniform gradient scale, so the losses alone would let it by
    want = grad_norms(baseline_dir)
    for name in ("full_shard", "full_shard_ac", "shard_grad_op", "no_shard", "no_accum", "size_wrap"):
        got = grad_norms(tmp_path / name)
        assert max(abs(a - b) / b for a, b in zip(got, want, strict=True)) < 1e-4, (name, got, want)
    # peak memory is the fullest rank's, not rank 0's: rank 1 reports 100 GiB more (dist_harness rank_memory)
    logged = [json.loads(line) for line in (tmp_path / "full_shard" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mem_rss_peak_gib"] > 100 for r in logged if "loss" in r), logged
    for name, overrides in MEASURED.items():
        error = traced_error(overrides, result["measured"][name], world_size=2)
        assert -UNDER <= error <= OVER, (name, error)


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_two_nodes_hybrid_shard_matches_one_process(assets, baseline, baseline_dir, tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), 2 ranks each, running the
    real CLI with hybrid_shard: replicate across the 2 'nodes', shard within each (2 x 2); final/
    written by all 4 ranks (checkpoint.sharded_final) loads in transformers with every weight."""
    args = ["-m", "shardtune", "train", *tiny_overrides(assets, tmp_path / "hsdp", **{
        "fsdp.sharding": "hybrid_shard", "checkpoint.sharded_final": "true", **WATCH})]
    results = torchrun(2, args, nnodes=2)
    for code, output in results:
        assert code == 0, output[-4000:]
    assert "hybrid_shard" in "".join(o for _, o in results)
    assert "final (sharded)" in "".join(o for _, o in results)  # written by the ranks, not gathered
    got = losses(tmp_path / "hsdp")
    assert max(abs(a - b) for a, b in zip(got, baseline, strict=True)) < TOL, (got, baseline)
    assert (tmp_path / "hsdp" / "final" / "model.safetensors").exists()
    # replicas counted once (a miscount is a factor sqrt(2)); 4e-5 seen: two-level gradient
    # reductions round differently, and Adam's normalised updates carry that into the weights
    same_watch(tmp_path / "hsdp", baseline_dir, tol=1e-4)
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hsdp" / "final", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights


def test_cli_nproc_two_runs_the_elastic_launcher(assets, baseline, tmp_path):
    proc = run_cli(["train", *tiny_overrides(assets, tmp_path / "cli"), "--nproc", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stdout
    got = losses(tmp_path / "cli")
    assert max(abs(a - b) for a, b in zip(got, baseline, strict=True)) < TOL
