"""float8 training (`float8=rowwise|tensorwise`): the decoder blocks' linear layers compute their
three matmuls in float8 through torchao, with dynamic scales; everything else stays in bf16, and
the master weights, gradients and optimizer stay as they were. Applied by `build.build_model`
before parallelism, so compile sees the float8 casts and FSDP shards the converted layers.

- rowwise: one scale per row (input, weight and gradient cast along the reduced dimension);
  the more accurate recipe.
- tensorwise: one scale per tensor; FSDP all-gathers the weights in float8 (half the traffic
  and the gathered memory of bf16), their scales computed for all layers at once after each
  optimizer step (and before the first forward).

Which layers: torchao's own filter for the recipe (dimensions divisible by 16, and large enough
that float8 is faster than bf16 on an H100), inside the decoder blocks only: the LM head,
embeddings and towers of other modalities keep bf16, as do `nn.Linear` subclasses with a
forward of their own. The float8 matmul needs compute capability 8.9 (Ada, Hopper) or newer.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from shardtune.errors import UserError
from shardtune.hardware import float8_needs

RECIPES = ("rowwise", "tensorwise")
MIN_CAPABILITY = (8, 9)


def check_device(recipe: str, device) -> None:
    """The machine's part of the float8 checks (config validation did the config's part)."""
    if recipe == "none":
        return
    if device.type != "cuda":
        raise UserError(f"{float8_needs(recipe)}; this run is on {device.type}: set float8=none")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise UserError(f"{float8_needs(recipe)}; {torch.cuda.get_device_name(device)} has "
                        f"{capability[0]}.{capability[1]}: set float8=none")
    _torchao()


def _torchao():
    try:
        import torchao.float8 as f8
    except ImportError:
        raise UserError("float8 needs torchao; pip install 'shardtune[lowbit]' (or set float8=none)") from None
    return f8


def _convertible(model, block_cls: type, recipe: str) -> list[nn.Linear]:
    """The linear layers `convert` turns to float8: inside a decoder block, plain `nn.Linear`
    forward, and passing torchao's filter for the recipe (which reads their names too)."""
    keep = _torchao()._auto_filter_for_recipe(recipe, filter_fqns=[])
    return [module for name, block in model.named_modules() if isinstance(block, block_cls)
            for sub, module in block.named_modules()
            if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and keep(module, f"{name}.{sub}" if sub else name)]


def convert(model, block_cls: type, recipe: str) -> int:
    """Swap the `_convertible` linear layers for torchao's Float8Linear in place (parameter names
    unchanged); the number swapped."""
    if recipe == "none":
        return 0
    f8 = _torchao()
    chosen = {id(m) for m in _convertible(model, block_cls, recipe)}
    if not chosen:
        return 0
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise":  # one scale per weight: FSDP can gather the float8 bytes
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    f8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: id(m) in chosen)
    if config.enable_fsdp_float8_all_gather:
        for layer in converted(model):
            layer.register_state_dict_post_hook(_plain_weight)
    return len(chosen)


def _plain_weight(module, state_dict, prefix, local_metadata) -> None:
    """A state dict holds plain values: the float8-gathered weight's wrapper (inside the DTensor
    once sharded) gives way to the tensor it wraps, sharing its storage, so that a checkpoint
    loaded into the state dict lands in the parameter."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and hasattr(value.to_local(), "_tensor"):
        state_dict[key] = DTensor.from_local(value.to_local()._tensor, value.device_mesh, value.placements,
                                             run_check=False, shape=value.shape, stride=value.stride())
    elif value is not None and hasattr(value, "_tensor"):
        state_dict[key] = value._tensor


def converted(model) -> list[nn.Linear]:
    """The Float8Linear layers of `model` (none without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def matmul_shapes(model) -> dict[str, int]:
    """What the planner prices of the converted layers: their weights' values (the matmul FLOPs
    float8 runs: 6 per value and token) and the sum of their input and output widths (the values
    per token the casts read and write)."""
    layers = converted(model)
    return {"float8_matmul": sum(m.in_features * m.out_features for m in layers),
            "float8_widths": sum(m.in_features + m.out_features for m in layers)}


def keep_scales_precomputed(model, optimizer, recipe: str) -> None:
    """tensorwise: every float8-gathered weight's scale in one all-reduce after each optimizer
    step (instead of one per layer at its all-gather), and before the first forward, so that a
    resumed run scales its weights as the run it continues did."""
    if recipe != "tensorwise" or not converted(model):
        return
    precompute = _torchao().precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute(model))

    def first_forward(*_):
        handle.remove()
        precompute(model)

    handle = model.register_forward_pre_hook(first_forward)


def describe(model, recipe: str, compiled: bool, activation_offload: bool = False) -> str:
    """The start-up line's part, e.g. ' | float8 rowwise: 84 linear layers'."""
    if recipe == "none":
        return ""
    # Without compile each cast is a few separate kernels over the activations: often slower than bf16.
    # With activation offload compile=true is refused (config.validation): advice it would refuse is none
    why = " (eager casts: activation_offload keeps the blocks eager)" if activation_offload else \
        " (eager casts: compile=true makes them fast)"
    return f" | float8 {recipe}: {len(converted(model))} linear layers{'' if compiled else why}"
