"""The attention FLOPs of a model, counted by torch's FlopCounterMode in the model itself (the
rest of MFU's FLOPs per token is `metrics.flops_per_token`)."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.families import hidden_size, layer_count

WEIGHT_MATMULS = {"aten.mm", "aten.addmm", "aten._grouped_mm"}  # what `metrics.matmul_params` counts


def attention_flops(hf_config, seq_len: int) -> float:
    """Forward FLOPs per token of the matmuls between activations (attention's scores and
    weighted values, of whatever kind a family has: grouped, latent, per-head sizes of its own)
    as torch's FlopCounterMode counts them in one forward of the real model on meta tensors with
    `seq_len` tokens; counted once per config and length. A model that does not run there (remote
    code) gets dense attention's 4 x layers x hidden x seq_len: telemetry never stops a run."""
    key = (hf_config.to_json_string(), seq_len)
    if key not in _COUNTED:
        from torch.utils.flop_counter import FlopCounterMode
        from transformers import AutoModelForCausalLM

        try:
            # on a copy: from_config writes its dtype into the config it is given, and the caller's
            # config keys plan's trace cache (a changed one misses it)
            with torch.device("meta"):  # bf16: the grouped expert matmul takes nothing else
                model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.bfloat16)
            ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
            with FlopCounterMode(display=False) as counter, _MetaScalars(), torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            counts = counter.get_flop_counts()["Global"]
            _COUNTED[key] = sum(n for op, n in counts.items() if str(op) not in WEIGHT_MATMULS) / seq_len
        except Exception:  # noqa: BLE001
            _COUNTED[key] = 4.0 * (layer_count(hf_config) or 0) * (hidden_size(hf_config) or 0) * seq_len
    return _COUNTED[key]


_COUNTED: dict[tuple[str, int], float] = {}


class _MetaScalars(TorchDispatchMode):
    """A meta tensor has no value: where the forward reads one (is the mask all ones? one
    sequence per row?) the answer is the plain case, True or 0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))
