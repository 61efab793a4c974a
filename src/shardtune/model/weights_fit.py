"""Whether a model folder's weight files fit its config, read from the safetensors headers only,
before a weight is loaded. An edited or mismatched config.json otherwise costs the whole load
and then fails (a size mismatch), fills the tensors it lacks with random values without a word
(a config with more layers than the weights), or allocates the model the config describes,
however large (a 7B Llama config beside GPT-2 weights: the process is killed for memory)."""

from __future__ import annotations

import re
from pathlib import Path

from shardtune.errors import UserError

# Safetensors dtypes of pre-quantized weights (packed integers): their element counts are not the model's.
PACKED = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "F8_E4M3", "F8_E5M2"}


def read_headers(files: list[Path]) -> tuple[dict[str, tuple[tuple[int, ...], str]], bool]:
    """{tensor name: (shape, file name)} of the weight files, and whether any tensor is packed."""
    from safetensors import safe_open

    shapes, packed = {}, False
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shapes[name] = (tuple(part.get_shape()), path.name)
                packed = packed or part.get_dtype() in PACKED
    return shapes, packed


def check_weights_fit(folder: Path, files: list[Path], model) -> None:
    """Refuse weights that do not fit `model` (the config's model, built on the meta device): a
    tensor of another shape, tensors missing where every tensor of the files has its place, or
    far fewer elements than the config describes. Names follow the model's (with or without its
    base model's prefix); a folder whose names the loader converts (fused experts) is compared by
    size only."""
    stored, packed = read_headers(files)
    expected = {name: tuple(p.shape) for name, p in model.state_dict(keep_vars=True).items()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    placed = {}
    for name in stored:
        for key in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
            if key in expected:
                placed[name] = key
                break
    where = f"model folder {str(folder)!r}"
    fix = "re-download or re-export the model, or correct its config.json (or model.config)"
    for name, key in placed.items():
        shape, file = stored[name]
        # a pre-quantized folder stores a weight packed into fewer elements (bitsandbytes' 4-bit: [n, 1])
        if shape != expected[key] and not (packed and _numel(shape) < _numel(expected[key])):
            raise UserError(f"{where}: weight {name} in {file} has shape {list(shape)} but the config makes it "
                            f"{list(expected[key])}; {fix}")
    if len(placed) == len(stored):  # every stored tensor has its place: what the model has beyond them is missing
        aliases: dict[int, set[str]] = {}  # a tied weight is stored under one of its names
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), set()).add(name)
        have, optional = set(placed.values()), getattr(model, "_keys_to_ignore_on_load_missing", None) or []
        missing = sorted(min(names) for names in aliases.values() if not names & have
                         and not any(re.search(pattern, name) for pattern in optional for name in names))
        if missing:
            raise UserError(f"{where} lacks {len(missing)} weight(s) that its config's model has (e.g. {missing[0]}): "
                            f"they would start random; {fix}")
    model_size = sum(p.numel() for p in model.parameters())
    stored_size = sum(_numel(shape) for shape, _ in stored.values())
    if not packed and model_size > 2 * stored_size:
        raise UserError(f"{where}: its config describes a model of {model_size:,} parameters but its weights "
                        f"hold {stored_size:,}; {fix}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
