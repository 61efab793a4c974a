"""QLoRA (peft.quantize=4bit) priced from the LoRA step's trace: bitsandbytes cannot run on fake
tensors (it needs CUDA), so the LoRA step is traced on one rank and its base is priced as the
QLoRA run holds it (`model.adapters.load_qlora_model`): every nn.Linear but the output head in
NF4 with double-quantized scales, the rest of the base in fp32 (peft's k-bit preparation), no FSDP
gathers, and one weight dequantized to bf16 at a time, in forward and again in backward."""

from __future__ import annotations

from shardtune.plan.trace import StepTrace

# NF4 with double quantization (QLoRA, Dettmers et al. 2023, section 3): 4 bits per value, an
# 8-bit scale per block of 64 values and an fp32 scale per 256 of those (0.127 bits per value)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# bytes each 4-bit weight streams per use: its codes and scales read, a bf16 copy written and read
# again by the matmul
DEQUANT_BYTES = NF4_BYTES + 2 + 2


_BASES: dict[tuple[str, bool], dict[str, int]] = {}  # per model config: a meta build of a 7B model takes seconds


def nf4_base(hf_config, trust_remote_code: bool = False) -> dict[str, int]:
    """{nf4_numel: values bitsandbytes stores in NF4, nf4_largest: the largest such weight,
    base_total: all the base's values} of the model `hf_config` describes (a meta build, cached)."""
    import torch

    from shardtune.model.hf import build_meta_model

    key = (hf_config.to_json_string(use_diff=False), trust_remote_code)
    if key not in _BASES:
        model = build_meta_model(hf_config, trust_remote_code)
        head = model.get_output_embeddings()
        linears = [m.weight.numel() for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and m is not head]  # transformers' modules_to_not_convert
        _BASES[key] = {"nf4_numel": sum(linears), "nf4_largest": max(linears, default=0),
                       "base_total": sum(p.numel() for p in model.parameters())}
    return _BASES[key]


def base_bytes(base: dict[str, int]) -> int:
    """The quantized base on the GPU: the NF4 linears, and the other values in fp32."""
    return int(base["nf4_numel"] * NF4_BYTES) + 4 * (base["base_total"] - base["nf4_numel"])


def quantized(trace: StepTrace, base: dict[str, int]) -> StepTrace:
    """The one-rank LoRA trace with its base held as QLoRA holds it: the fp32 values of the NF4
    linears become their NF4 bytes; FSDP's gathered copies become one dequantized bf16 weight."""
    delta = int(base["nf4_numel"] * NF4_BYTES) - 4 * base["nf4_numel"]
    dequantized = 2 * base["nf4_largest"]

    def held(cats: dict[str, int], phase: bool = True) -> dict[str, int]:
        out = {**cats, "sharded_params": max(0, cats.get("sharded_params", 0) + delta)}
        if phase:
            out["gathered_params"] = dequantized
        return out
    return StepTrace({k: held(v) for k, v in trace.phases.items()}, trace.layers, held(trace.steady, phase=False),
                     {**trace.params, **base})


def dequant_seconds(params: dict, forwards: float, accum: int, hbm_gbs: float) -> float:
    """bitsandbytes dequantizes each 4-bit weight per use: in forward, in backward (the input's
    gradient) and in each recomputed forward; memory-bound."""
    return accum * (2 + forwards) * params.get("nf4_numel", 0) * DEQUANT_BYTES / (hbm_gbs * 1e9)
