"""final/ written by every rank together in Hugging Face's format, no rank holding a full copy.

The layout `save_pretrained` would give the model (the same file names, the same split over
files, the same keys, a tied head written once, the index when there is more than one file) is
known before any byte is written, so each output file is created at its full size with its
safetensors header (the files spread over the ranks), and then every rank writes the rows of
each tensor it owns straight to their place in the file: the bytes are written once, and a
rank's memory never grows by more than one chunk of rows (none on CPU), whatever the model size.
The output folder must be on a file system that every rank sees (shared across nodes).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.errors import UserError
from shardtune.model.hf_sharded_io import (
    SAFETENSORS_DTYPES,
    create_safetensors,
    file_layout,
    hf_file_plan,
    naming,
    read_safetensors_into,
    write_index_and_configs,
    write_rows,
)


def _my_rows(t) -> tuple[int, torch.Tensor] | None:
    """(first row in the full tensor, the rows) of `t` this rank writes: a dim-0 shard's own rows,
    a replicated one's only on the first replica; None where another rank writes them."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return (0, t) if dist.get_rank() == 0 else None
    coord = t.device_mesh.get_coordinate()
    local = t.to_local()
    if coord is None or not local.numel() or any(isinstance(p, Replicate) and c for p, c in zip(t.placements, coord)):
        return None
    return (t.__create_chunk_list__()[0].offsets[0] if t.dim() else 0), local


def _writable(state_dict: dict) -> bool:
    """Every tensor's local part is whole rows (sharded on dim 0 only, or replicated), in a
    dtype safetensors names: then a rank's part is one contiguous range of the file."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def ok(t):
        placed = not isinstance(t, DTensor) or all(isinstance(p, Replicate) or p == Shard(0) for p in t.placements)
        return placed and t.dtype in SAFETENSORS_DTYPES

    return all(ok(t) for t in state_dict.values())


def require_hf_writable(model, hf_config) -> None:
    """checkpoint.hf_format: save_hf_sharded must be able to write `model` (keys kept on save,
    placements, dtypes), else one line."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state_dict = get_model_state_dict(model)
    if not _writable(state_dict):
        _refuse(hf_config)
    check_hf_keys(state_dict, hf_config)


def check_hf_keys(state_dict: dict, hf_config) -> None:
    """checkpoint.hf_format's keys (a meta skeleton's will do: check.run's, before anything is
    built): transformers must save them as they are named, else one line."""
    if hf_file_plan(hf_config, state_dict, "2GB") is None:
        _refuse(hf_config)


def _refuse(hf_config) -> None:
    raise UserError(f"checkpoint.hf_format=true cannot write this {hf_config.model_type!r} model in place: "
                    "transformers renames its weights on save; set checkpoint.hf_format=false and use "
                    "`shardtune export` on a checkpoint")


def save_hf_sharded(model, hf_config, tokenizer, out: Path, max_shard_size: int | str = "2GB",
                    generation=None) -> bool:
    """Collective: every rank writes its part of `model` (FSDP2-sharded) into `out` (the same
    path on every rank, an existing empty folder). Returns False, having written nothing, when
    the model's keys or placements cannot be written this way (the caller gathers instead)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state_dict = get_model_state_dict(model)
    plan = hf_file_plan(hf_config, state_dict, max_shard_size) if _writable(state_dict) else None
    if plan is None:
        return False
    shell, file_of = plan
    files = sorted(set(file_of.values()))
    layout = {name: file_layout(state_dict, sorted(k for k, f in file_of.items() if f == name)) for name in files}
    rank, world = dist.get_rank(), dist.get_world_size()
    together(lambda: [create_safetensors(out / name, *layout[name]) for name in files[rank::world]])
    together(lambda: [_fill(out / name, layout[name][1], state_dict) for name in files])
    together(lambda: write_index_and_configs(out, shell, file_of, hf_config, tokenizer, generation)
             if rank == 0 else None)
    return True


def _fill(path: Path, offsets: dict[str, int], state_dict: dict) -> None:
    """This rank's rows of every tensor in the file, each at its place, on disk before the folder
    is published (as DCP syncs a checkpoint's files before its meta.json marks it complete)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for key, at in offsets.items():
            if (mine := _my_rows(state_dict[key])) is not None:
                first, rows = mine
                row_bytes = rows[0].numel() * rows.element_size() if rows.dim() and len(rows) else 0
                write_rows(fd, path, at + first * row_bytes, rows)
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def read_model_part(model_state: dict, folder: Path, no_dist: bool) -> None:
    """A checkpoint's model written by save_hf_sharded (checkpoint.hf_format) into `model_state`,
    the state dict a DCP load of its "model" part would fill; a key the files lack must be a tied
    copy of one they hold (the head of a tied model, written once)."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        lacking = read_safetensors_into(model_state, folder, no_dist)
    held = {_storage(v) for k, v in model_state.items() if k not in lacking}
    untied = sorted(k for k in lacking if _storage(model_state[k]) not in held)
    if untied:
        raise UserError(f"checkpoint {str(folder)!r} lacks {untied[0]} in its safetensors files; it is damaged: "
                        "use another checkpoint")


def _storage(t) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def together(step) -> None:
    """Collective: run `step` on every rank; if it fails on any, it fails on all instead of
    leaving them waiting: the failing rank raises its own error, the others the same filesystem
    error or UserError (so rank 0 prints the one line, whichever rank hit it), else a line naming
    the rank and its error."""
    error = None
    try:
        step()
    except BaseException as exc:  # noqa: B036 - the others must learn of any failure, or they wait
        error = exc
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, _told(error))
    if error is not None:
        raise error
    rank, told = next(((r, t) for r, t in enumerate(seen) if t is not None), (None, None))
    if told is None:
        return
    if told[0] == "os":
        raise OSError(*told[1:])
    if told[0] == "user":
        raise UserError(told[1])
    raise RuntimeError(f"rank {rank} failed writing its part of the model folder ({told[1]})")


def _told(error: BaseException | None):
    """What the other ranks need of a failure: a filesystem error whole, else its first line."""
    if error is None:
        return None
    if isinstance(error, OSError) and error.errno is not None:
        return ("os", error.errno, error.strerror, error.filename)
    if isinstance(error, UserError):
        return ("user", str(error))
    return ("other", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
