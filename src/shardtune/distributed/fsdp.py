"""FSDP2: the device mesh and the one function that applies parallelism, in a fixed order:
activation checkpointing (and offloading) -> compile -> fully_shard per unit -> fully_shard on the root.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.config.load import hybrid_mesh
from shardtune.config.schema import FSDPConfig
from shardtune.distributed.activation_memory import ActivationOffload, apply_checkpointing
from shardtune.distributed.process_group import Dist
from shardtune.errors import UserError
from shardtune.families import family


def detect_block_class(model, override: str | None = None) -> type:
    """The decoder-block class that becomes one FSDP unit (GPT2Block, OPTDecoderLayer, ...): the
    override, else the family's (families.py), else the element class of the ModuleList that holds
    the language model's blocks (ranked below)."""
    classes = {type(m).__name__: type(m) for m in model.modules()}
    if override:
        if override not in classes:
            candidates = sorted(n for n in classes if "Block" in n or "Layer" in n)
            raise UserError(f"fsdp.block_class={override!r} is not a module of this model; "
                            f"candidates: {', '.join(candidates) or 'none'}")
        return classes[override]
    known = family(getattr(getattr(model, "config", None), "model_type", None))
    if known and known.block in classes:
        return classes[known.block]
    # The decoder stack is a ModuleList of blocks; a multimodal model has others (a vision tower's,
    # as long or longer). Ranked: a class transformers names in `_no_split_modules` (a set that may
    # also name attention or embeddings, which are no stack's elements), then the list nearest the
    # token embedding (it shares the language model's path), then the shallower, then the longer;
    # the first of equals in module order, so the choice never depends on a set's order.
    named = set(getattr(model, "_no_split_modules", None) or [])
    embedding = _path_of(model, _input_embeddings(model)).split(".")
    lists = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise UserError("could not find the decoder blocks of this model; set fsdp.block_class=<class name>")

    def rank(item):
        path, blocks = item
        parts = path.split(".")
        shared = next((i for i, (a, b) in enumerate(zip(parts, embedding)) if a != b), min(len(parts), len(embedding)))
        return type(blocks[0]).__name__ in named, shared, -len(parts), len(blocks)

    return type(max(lists, key=rank)[1][0])


def decoder_blocks(model, block_cls: type) -> list:
    """The blocks freeze.trainable_blocks counts: the FSDP units' (`block_cls`), or the detected decoder
    blocks where fsdp.block_class names a module inside them (an attention: the lower layers' MLPs trained)."""
    blocks = [m for m in model.modules() if isinstance(m, block_cls)]
    try:
        detected = detect_block_class(model)
    except UserError:
        return blocks
    outer = [m for m in model.modules() if isinstance(m, detected)]
    inside = {id(m) for block in outer for m in block.modules() if m is not block}
    return outer if detected is not block_cls and blocks and all(id(b) in inside for b in blocks) else blocks


def _input_embeddings(model):
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def _path_of(model, module) -> str:
    return next((path for path, m in model.named_modules() if m is module), "") if module is not None else ""


def build_mesh(fsdp: FSDPConfig, dist: Dist):
    """1-D mesh for full_shard/shard_grad_op; 2-D (replicate, shard) for hybrid_shard and no_shard."""

    world = dist.world_size
    sharding = fsdp.sharding
    if sharding in ("full_shard", "shard_grad_op"):
        return init_device_mesh(dist.device.type, (world,), mesh_dim_names=("shard",))
    if sharding == "no_shard":  # pure data parallel: replicate everywhere, shard groups of one
        replicate, shard = world, 1
    else:
        replicate, shard = hybrid_mesh(fsdp, world, dist.local_world_size)
    return init_device_mesh(dist.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def mixed_precision(precision: str, reduce_dtype: str = "fp32"):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    # Compute in low precision, keep fp32 master weights (and sharded gradients); reduce gradients
    # in fp32, or in bf16 (fsdp.reduce_dtype: half the traffic and no fp32 copy of the unsharded
    # gradient; validation allows it with bf16 compute only).
    reduce = {"fp32": torch.float32, "bf16": torch.bfloat16}[reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)


def reshard_after_forward(sharding: str, shard_group_size: int, device_type: str) -> bool:
    """The sharding policy, decided here only: free gathered parameters after forward (and keep
    gradients sharded between micro-batches) for full_shard and hybrid_shard. With one rank in the
    shard group the gathered copy is still a second copy of the unit (bf16 beside fp32 weights: a
    7B model's 12.6 GiB held from forward into backward), so a GPU frees it, as FSDP2 does by
    default: there memory is the limit and gathering again is a copy on the device. A CPU run keeps
    it: RAM is plentiful and the copy is 10 % of a 1-rank step (shard_grad_op keeps it anywhere)."""
    if sharding not in ("full_shard", "hybrid_shard"):
        return False
    return shard_group_size > 1 or device_type != "cpu"


def apply_parallelism(model, spec, block_cls: type, mesh, device) -> tuple[list, bool]:
    """Shard `model` in place as `spec` (build.ModelSpec) says. Returns the FSDP units (in
    forward order) below the root, and whether they are resharded after forward."""

    fsdp = spec.fsdp
    blocks = [m for m in model.modules() if isinstance(m, block_cls)]

    apply_checkpointing(model, blocks, spec.activation_checkpointing, spec.activation_checkpointing_every)
    if spec.activation_offload:
        ActivationOffload(device).install(model)

    if spec.compile:
        for block in blocks:
            block.compile()  # in place: parameter names unchanged

    kwargs = dict(
        mesh=mesh,
        mp_policy=mixed_precision(spec.precision, fsdp.reduce_dtype),
        # pinned host memory needs CUDA; on CPU, pinning fails
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload
        else OffloadPolicy(),
    )
    reshard = reshard_after_forward(fsdp.sharding, mesh.size(mesh.ndim - 1), spec.device_type or device.type)
    _silence_checked_views(model, block_cls, fsdp.wrap)
    units = blocks if fsdp.wrap == "block" else size_based_units(model, fsdp.min_num_params)
    for unit in units:
        # the last unit's backward comes right after its forward: freeing it would only re-gather it
        fully_shard(unit, reshard_after_forward=reshard and unit is not units[-1], **kwargs)
    if fsdp.wrap == "block":
        _shard_embeddings(model, reshard, kwargs)
    # The root keeps what is left (final norm, ...); it is needed again right at the start of backward.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    _set_prefetch(units, fsdp.forward_prefetch, fsdp.backward_prefetch)
    return units, reshard


def _silence_checked_views(model, block_cls: type, wrap: str) -> None:
    """FSDP2's warning that a unit returned a view, for a family whose views are checked
    (families.Family.view_output_checked): its block, its head (a head with a bias returns its
    logits as a view) and the root that hands them on; nothing writes into them in place and the
    gradients equal the unwrapped model's (tests/model/test_build.py). Size-based units are other
    modules, whose callers were not checked: their warning stays."""
    known = family(getattr(getattr(model, "config", None), "model_type", None))
    if not (known and known.view_output_checked and known.block == block_cls.__name__):
        return
    head = model.get_output_embeddings() if wrap == "block" else None
    names = [block_cls.__name__, type(model).__name__, *([type(head).__name__] if head is not None else [])]
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(FSDP({'|'.join(names)})\) returned a view")


def _shard_embeddings(model, reshard: bool, kwargs: dict) -> None:
    """Input embeddings and LM head as units of their own: left in the root they would stay
    unsharded on every rank from forward to the end of backward (GPT-2's are 30 % of it). A tied
    pair shares one weight, so it must be one unit; it is freed after backward. An embedding whose
    weight a forward reads beside the lookup stays gathered after its own forward (resharded, it
    would be a sharded DTensor there)."""

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is None or any(isinstance(p, DTensor) for p in emb.parameters()):
        return
    if _shared_outside(model, [emb, head] if head is not None else [emb]):
        return  # BERT's head bias is its parent's too: a unit of its own would split one parameter
    if head is not None and head.weight is emb.weight:
        # Gathered from the first forward op to the last anyway, and the head opens backward:
        # resharding after forward would only gather the largest unit again at once.
        fully_shard([emb, head], reshard_after_forward=False, **kwargs)
        return
    fully_shard(emb, reshard_after_forward=reshard and not reads_embedding_weight(model, emb), **kwargs)
    if head is not None and not any(isinstance(p, DTensor) for p in head.parameters()):
        fully_shard(head, reshard_after_forward=False, **kwargs)  # backward starts with it


def _shared_outside(model, group: list) -> bool:
    """Whether a parameter of the modules in `group` is also registered by a module outside it."""
    from collections import Counter

    def uses(modules):
        return Counter(id(p) for m in modules for _, p in m.named_parameters(remove_duplicate=False))

    inside, everywhere = uses(group), uses([model])
    return any(everywhere[pid] > n for pid, n in inside.items())


def reads_embedding_weight(model, emb) -> bool:
    """Whether a forward on the way from `model` to its input embedding `emb` reads the embedding's
    weight itself, not through its lookup (Gemma 4's multimodal model takes the pad token's row)."""
    import inspect
    import re

    parts = _path_of(model, emb).split(".")
    # its values, not where it lives (Llama 4 moves the ids to `embed_tokens.weight.device`)
    read = re.compile(rf"(\b{re.escape(parts[-1])}|get_input_embeddings\(\))\.weight\b(?!\.(device|dtype)\b)")
    for depth in range(len(parts)):
        try:
            source = inspect.getsource(type(model.get_submodule(".".join(parts[:depth]))).forward)
        except (OSError, TypeError):  # no Python source (a compiled or built-in forward)
            continue
        if read.search(source):
            return True
    return False


def size_based_units(model, min_num_params: int) -> list:
    """Post-order walk: a subtree becomes a unit once it holds >= min_num_params not yet in a unit.
    Modules without a forward (ModuleList/ModuleDict, and ParameterDict/ParameterList, whose
    parameters their parent reads directly: peft's IA3 vectors; FSDP gathers a unit only when it is
    called), the modules inside a peft adapter layer (its forward reads lora_A's weight dtype, which
    a unit of its own changes between forward and a checkpoint's recomputation under mixed
    precision) and subtrees holding a tied parameter (e.g. input embeddings shared with the LM head:
    both must live in one unit) pass it up."""
    import sys
    from collections import Counter

    # a model with adapters has imported peft; without peft (an extra) no module is an adapter layer
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    adapter_layer = tuners.BaseTunerLayer if tuners is not None else ()

    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    tied = {pid for pid, n in uses.items() if n > 1}
    units = []

    def visit(module, in_adapter: bool = False) -> int:
        pending = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            pending += visit(child, in_adapter or isinstance(module, adapter_layer))
        eligible = not in_adapter and type(module).forward is not nn.Module.forward and \
            not any(id(p) in tied for p in module.parameters())
        if module is not model and eligible and pending >= min_num_params:
            units.append(module)
            return 0
        return pending

    visit(model)
    return units


def _set_prefetch(units: list, forward: int, backward: int) -> None:
    """FSDP2 prefetches one unit ahead implicitly; these settings make it explicit or deeper."""
    if forward > 0:
        for i, unit in enumerate(units[:-1]):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + forward])
    if backward != 1:
        for i, unit in enumerate(units[1:], start=1):
            unit.set_modules_to_backward_prefetch(units[max(0, i - backward):i][::-1] if backward else [])
