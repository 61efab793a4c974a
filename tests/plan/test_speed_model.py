"""The planner's speed model against the steps measured on GPUs: for each measured one-GPU row,
`cost.step_time` (the FLOPs of the model's matmuls and attention at the assumed MFU, plus the
optimizer's memory-bound step) predicts tokens/s within 15 % of what `bench/vs_hf_trainer.py --gpu`
measured. A new GPU row goes into ROWS; if it lands outside, the assumption (hardware.HOST_FACTS
"mfu") is what to refit, not the tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from vs_hf_trainer import SETUPS  # noqa: E402  the benchmark's models, as measured

H200_RUN = ROOT / "bench/gpu/results/2026-11-26-h200/call2/vs_hf_llama.json"
H200_COMPILED_RUN = ROOT / "bench/gpu/results/2026-11-26-h200-c/call2/vs_hf_llama.json"
# (setup, GPU, measured tokens/s: the bench table's median over its runs, or the run file it is read
# from, compile=true or not). All seq 2048, bf16, full_shard on one GPU, micro-batch 4 of a global
# batch of 8. The H100 rows are in ../shared/gpu-runs/2026-11-25-h100/ (vs_hf_llama.md;
# vs_hf_opt_partial.md, shardtune's run only: HF's never finished there)
ROWS = [
    pytest.param("gpu", "H100", 48637, False, id="llama-1b-h100"),
    pytest.param("gpu", "H200", H200_RUN, False, id="llama-1b-h200"),
    pytest.param("gpu-opt", "H100", 41752, False, id="opt-1.3b-h100"),
    pytest.param("gpu", "H200", H200_COMPILED_RUN, True, id="llama-1b-h200-compiled"),
]
TOLERANCE = 0.15


def measured_tokens_per_s(run: Path) -> float:
    table = json.loads(run.read_text())
    runs = sorted(float(r["tok/s"]) for r in table["runs"] if r["side"] == "shardtune")
    return (runs[(len(runs) - 1) // 2] + runs[len(runs) // 2]) / 2  # the median, as the bench's table


@pytest.mark.parametrize("setup, gpu_name, measured, compiled", ROWS)
def test_predicted_tokens_per_second_is_within_15_percent_of_the_measured_gpu_rows(assets, setup, gpu_name,
                                                                                    measured, compiled):
    from transformers import AutoConfig

    from shardtune.config.load import load_config
    from shardtune.hardware import gpu_by_name
    from shardtune.model.hf import build_meta_model
    from shardtune.plan.cost import Candidate, Target, step_time
    from shardtune.plan.trace import parameter_counts

    measured = measured_tokens_per_s(measured) if isinstance(measured, Path) else measured
    model = SETUPS[setup]["model"]
    cfg = load_config(None, [f"model.config={json.dumps(model)}", f"model.tokenizer={assets['tokenizer']}",
                             f"data.path={Path(assets['train']).parent}", "data.seq_len=2048", "precision=bf16",
                             "train.micro_batch_size=4", "train.global_batch_size=8",
                             f"compile={str(compiled).lower()}"])
    hf_config = AutoConfig.for_model(**model)
    params = parameter_counts(build_meta_model(hf_config))  # what a trace records of the model
    gpu = gpu_by_name(gpu_name)
    seconds = step_time(SimpleNamespace(params=params, layers=model["num_hidden_layers"]), hf_config,
                        Candidate("full_shard", "bf16", 4), cfg, Target(1, 1, gpu.memory_bytes, gpu), accum=2)
    predicted = 8 * 2048 / seconds["total"]
    assert abs(predicted / measured - 1) < TOLERANCE, f"predicted {predicted:,.0f} tokens/s, measured {measured:,.0f}"
