"""MFU's FLOPs: a device's peak, and the training FLOPs per token of a model: its matmul weights
(`matmul_params`, as far as backward reaches) and its attention, counted by torch's
FlopCounterMode in the model itself."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune import hf_patches
from shardtune.families import config_value, hidden_size, layer_count

WEIGHT_MATMULS = {"aten.mm", "aten.addmm", "aten._grouped_mm"}  # what `matmul_params` counts
# the experts a token is routed to, as transformers' configs of mixtures of experts name them (Gemma 4:
# top_k_experts, Aria and HunYuan: moe_topk, Ernie 4.5: moe_k); where none is set, experts were not counted
TOP_K = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "num_experts_per_token")


def attention_flops(hf_config, seq_len: int) -> float:
    """Forward FLOPs per token of the matmuls between activations (attention's scores and
    weighted values, of whatever kind a family has: grouped, latent, per-head sizes of its own)
    as torch's FlopCounterMode counts them in one forward of the real model on meta tensors with
    `seq_len` tokens; counted once per config and length. A model that does not run there (remote
    code) gets dense attention's 4 x layers x hidden x seq_len: telemetry never stops a run."""
    # the whole dict: to_json_string's diff against the class defaults builds a default config (5x the
    # time, and plan's search asks ~4,400 times)
    key = (json.dumps(hf_config.to_dict(), sort_keys=True, default=str), seq_len)
    if key not in _COUNTED:
        from torch.utils.flop_counter import FlopCounterMode
        from transformers import AutoModelForCausalLM

        try:
            # on a copy: from_config writes its dtype into the config it is given, and the caller's
            # config keys plan's trace cache (a changed one misses it)
            # transformers' own modules: a patched family's Triton kernels fault on meta tensors
            with hf_patches.originals():
                with torch.device("meta"):  # bf16: the grouped expert matmul takes nothing else
                    model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.bfloat16)
                ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
                ran: set = set()
                hook = nn.modules.module.register_module_forward_pre_hook(lambda m, args: ran.add(id(m)))
                try:
                    with FlopCounterMode(display=False) as counter, _MetaScalars(), torch.no_grad():
                        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
                finally:
                    hook.remove()
            counts = counter.get_flop_counts()["Global"]
            _COUNTED[key] = sum(n for op, n in counts.items() if str(op) not in WEIGHT_MATMULS) / seq_len
            _IDLE[key[0]] = {name: id(m) not in ran for name, m in model.named_modules()}
        except Exception:  # noqa: BLE001
            _COUNTED[key] = 4.0 * (layer_count(hf_config) or 0) * (hidden_size(hf_config) or 0) * seq_len
    return _COUNTED[key]


_COUNTED: dict[tuple[str, int], float] = {}
# per config: each module of the model as transformers builds it, and whether a forward of tokens leaves it
# idle (a multimodal model's vision and audio towers, a decoder's cross-attention without an encoder)
_IDLE: dict[str, dict[str, bool]] = {}
IDLE_PROBE_TOKENS = 16  # a forward this long shows which modules tokens meet (unless told the run's length)


def idle_modules(model, seq_len: int | None = None) -> Callable[[str], bool]:
    """Whether a module of `model` (by name) never runs in a forward of tokens: the module of
    transformers' own model it is, or the nearest one it lies in (peft's wrappers and adapters lie in
    the layer they adapt), is idle in `attention_flops`' forward (of `seq_len` tokens: the one the
    run's MFU counts anyway). None idle where that did not run."""
    config = getattr(model, "config", None)
    if config is None or not (getattr(config, "sub_configs", None) or getattr(config, "is_decoder", False)
                              or getattr(config, "add_cross_attention", False)):
        return lambda name: False  # a plain decoder (no towers, no encoder's side): every module runs
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if key not in _IDLE:
        attention_flops(config, seq_len or IDLE_PROBE_TOKENS)
    idle = _IDLE.get(key, {})
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapped model
    prefix = next((f"{name}." for name, m in model.named_modules() if m is base and name), "")

    def is_idle(name: str) -> bool:
        parts = name.removeprefix(prefix).split(".") if name.startswith(prefix) else [""]
        for end in range(len(parts), -1, -1):
            found = idle.get(".".join(parts[:end]))
            if found is not None:
                return found
        return False

    return is_idle


class _MetaScalars(TorchDispatchMode):
    """A meta tensor has no value: where the forward reads one (is the mask all ones? one
    sequence per row?) the answer is the plain case, True or 0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def device_peak_flops(device, precision: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device for this precision, or None when unknown (e.g. a CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None

    from shardtune.hardware import gpu_by_device_name

    gpu = gpu_by_device_name(torch.cuda.get_device_name(device))
    return gpu.peak_flops(precision) if gpu is not None and gpu.supports(precision) else None


def flops_per_token(num_params: int, hf_config, seq_len: int, trainable: int | None = None) -> float:
    """Useful training FLOPs per token of a `seq_len`-token sequence for N matmul weights
    (`matmul_params`): 2N forward + 2N backward through the activations + 2N for weight gradients
    of the trainable ones (6N when all train), plus 3 x the forward's attention FLOPs
    (`attention_flops`). Recomputation by activation checkpointing is not counted: MFU measures
    useful work."""
    return _weight_flops(num_params, trainable) + 3.0 * attention_flops(hf_config, seq_len)


def flops_rates(num_params: int, hf_config, seq_len: int, trainable: int | None = None,
                reach: tuple[int, float] | None = None) -> tuple[float, float]:
    """(training FLOPs per token of the weights, training FLOPs per (query, key) pair of attention):
    `flops_per_token` split so that a step's attention follows its documents' lengths, not
    `seq_len`'s. Attention's FLOPs per token grow with the tokens attended to (counted at `seq_len`
    by `attention_flops`), so a document of l tokens costs l² pairs: a short instruct example (padded
    or not) or a document of a masked packed row costs what it computes alone; l = seq_len is
    `flops_per_token`. `reach`: how far backward goes (`backward_reach`; None: through everything)."""
    input_grads, attention_share = reach if reach is not None else (None, 1.0)
    return (_weight_flops(num_params, trainable, input_grads),
            (1.0 + 2.0 * attention_share) * attention_flops(hf_config, seq_len) / seq_len)


def _weight_flops(num_params: int, trainable: int | None, input_grads: int | None = None) -> float:
    return (2.0 * num_params + 2.0 * (num_params if input_grads is None else input_grads)
            + 2.0 * (num_params if trainable is None else trainable))


def values(param) -> int:
    """The values a parameter holds: its numel, but for bitsandbytes' 4-bit weights (QLoRA's base),
    which pack two values into each byte of their storage dtype (bf16: numel is a quarter of the
    values). peft's get_nb_trainable_parameters rule."""
    if type(param).__name__ != "Params4bit":
        return param.numel()
    storage = getattr(param, "quant_storage", None)
    return param.numel() * 2 * (storage.itemsize if storage is not None else param.element_size())


def _matmul_weights(model, seq_len: int | None = None):
    """(elements a token is multiplied by, the weight, whether backward computes that matmul's input
    gradient) of each weight `matmul_params` counts, in model order (embeddings first, head last).
    Backward computes an input gradient only on the way to a parameter that trains: below the
    first one (frozen blocks under freeze.trainable_blocks, all but the head with freeze.head_only)
    it stops. A peft model's frozen input embedding passes a gradient on (adapters._inputs_carry_grad):
    every weight's."""
    top_k = config_value(model.config, *TOP_K)
    below_trained = hasattr(model, "peft_config")
    idle = idle_modules(model, seq_len)
    for name, module in model.named_modules():
        if idle(name):  # no token meets it: a vision tower in a text run
            continue
        # the module's own parameter: an adapter's wrapper (peft's lora.Linear) answers `weight` with
        # its base layer's, which is counted where it lives
        weight = module._parameters.get("weight")
        if not isinstance(module, nn.Embedding) and weight is not None and weight.ndim == 2:
            yield values(weight), weight, below_trained
        for param in module.parameters(recurse=False):
            if param.ndim == 3 and top_k:
                yield param.numel() * min(top_k, param.shape[0]) // param.shape[0], param, below_trained
        below_trained = below_trained or any(p.requires_grad for p in module.parameters(recurse=False))


def matmul_params(model, seq_len: int | None = None) -> tuple[int, int]:
    """(all, trainable) elements of the weights one token is multiplied by: 2-D weights outside
    embedding lookups (an LM head counts even when tied to the input embedding: it multiplies),
    and of a mixture of experts' fused 3-D expert weights (experts x ...) only the share of the
    experts each token is routed to (`TOP_K` of them): FLOPs follow the active
    experts, memory (not counted here) all of them. Each weight counts once, where it is a parameter."""
    weights = list(_matmul_weights(model, seq_len))
    return sum(n for n, _, _ in weights), sum(n for n, w, _ in weights if w.requires_grad)


def backward_reach(model, block_cls: type | None, seq_len: int | None = None) -> tuple[int, float]:
    """How far backward goes: (the elements of `matmul_params`' weights whose input gradient it
    computes, 2 FLOPs per token each; the share of the `block_cls` blocks whose attention it passes
    through, 2 x attention's forward FLOPs each). All of them, 1.0, in a model whose first parameters
    train; with freeze.trainable_blocks=k, the top k blocks'; with freeze.head_only, none."""
    through = sum(n for n, _, reached in _matmul_weights(model, seq_len) if reached)
    modules = list(model.modules())
    first = 0 if hasattr(model, "peft_config") else next(
        (i for i, m in enumerate(modules) if any(p.requires_grad for p in m.parameters(recurse=False))), len(modules))
    # a block is reached when a trained parameter lies in it or before it: its last module's index
    ends = [i + sum(1 for _ in m.modules()) - 1 for i, m in enumerate(modules)
            if block_cls is not None and isinstance(m, block_cls)]
    return through, (sum(first <= end for end in ends) / len(ends) if ends else 1.0)
