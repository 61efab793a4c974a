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



@pytest.mark.parametrize("peak_tflops", [None, 200.0])
@pytest.mark.parametrize("gpu_name", ["H100", "A100-80GB", "V100-16GB", "T4", None])
def test_every_precision_has_a_peak_in_the_ratio_of_the_card(gpu_name, peak_tflops):
    """A card without bf16 units priced bf16 at a peak of 0 (plan's LoRA suggestion for a bf16 recipe
    on a T4: ZeroDivisionError), and --peak-tflops, the 16-bit peak, priced fp32 at it too (fp32 tied
    with bf16 on an A100, 16x too fast). Now: emulated precisions at the fp32 rate, and the flag
    scales the card's own ratios (a card from --gpu-mem alone: the nominal card's)."""
    from shardtune.hardware import gpu_by_name
    from shardtune.plan.cost import Target

    gpu = gpu_by_name(gpu_name) if gpu_name else None
    target, bare = Target(1, 1, 1 << 34, gpu, peak_tflops), Target(1, 1, 1 << 34, gpu)
    sixteen = max(bare.peak_flops("bf16"), bare.peak_flops("fp16"))
    scale = peak_tflops * 1e12 / sixteen if peak_tflops else 1.0
    for precision in ("bf16", "fp16", "fp32", "fp8"):
        own = gpu.peak_flops(precision) if gpu else bare.peak_flops(precision)
        expected = (own or bare.peak_flops("fp32")) * scale
        assert target.peak_flops(precision) == pytest.approx(expected) and expected > 0, precision
    assert target.peak_flops("fp32") < target.peak_flops("fp16")
