"""Hugging Face safetensors read by every rank for its own shards (issue 22), the file layout
`save_pretrained` gives a state dict, and safetensors files written tensor by tensor at known
offsets (`file_layout`, `write_rows`: checkpoint.hf_sharded's writer, and export's).

`load_hf_sharded` fills an FSDP2-sharded meta model through DCP's `HuggingFaceStorageReader`:
each rank reads only the slices it owns, cast to the parameters' dtype on the way in, a chunk
of rows at a time through its own opening of the file (`ChunkedReader`), so the file's mapped
pages leave the process after each chunk instead of adding up to the rank's whole part. Where
that cannot be done (no local safetensors folder, checkpoint keys that differ from the module
names) it returns False and the caller keeps rank 0's load + broadcast.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.fsio import json_loads

READ_CHUNK = 16 << 20  # bytes of the file mapped at once while reading
WRITE_CHUNK = 64 << 20  # bytes of rows copied off the device and written at once
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def hf_file_plan(hf_config, state_dict: dict, max_shard_size: int | str) -> tuple[object, dict[str, str]] | None:
    """(a meta shell of the model, {key: file name}) as `save_pretrained` would write `state_dict`
    (tied copies dropped, files split at max_shard_size); None when transformers would rename keys
    on save (a conversion mapping), which this path does not reproduce."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion

    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state_dict.items()}
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    shell.load_state_dict(meta, assign=True, strict=False)
    shell.tie_weights()
    kept = remove_tied_weights_from_state_dict(dict(shell.state_dict()), shell)
    if set(revert_weight_conversion(shell, dict(kept))) != set(kept) or not set(kept) <= set(state_dict):
        return None
    split = split_torch_state_dict_into_shards(kept, max_shard_size=max_shard_size)
    return shell, {k: name for name, keys in split.filename_to_tensors.items() for k in keys}


def local_safetensors_folder(name_or_path: str | None) -> Path | None:
    """The folder holding the model's safetensors, from a local path or the Hugging Face cache
    (`shardtune download` fills it); None if there is none (the broadcast path reads it then)."""
    if not name_or_path:
        return None
    folder = Path(name_or_path)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(name_or_path, local_files_only=True))
        except Exception:  # not cached, not a repo id: the broadcast path says what is wrong
            return None
    return folder if any(folder.glob("*.safetensors")) else None


def _buffers_of(hf_config, trust_remote_code: bool) -> dict[str, torch.Tensor]:
    """The model's buffers (rotary frequencies, masks: not in the checkpoint) built on CPU,
    with the parameters left on meta: a few KB, computed alike on every rank."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        shell = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return dict(shell.named_buffers())


def _chunked_reader(folder: Path):
    """DCP's Hugging Face reader (its metadata and load plan unchanged) whose reads go a chunk of
    rows at a time, each through a fresh safetensors mapping dropped after the copy: a rank's
    memory grows by its part of the model plus one chunk, not by the file pages it touched."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.futures import Future

    class ChunkedReader(HuggingFaceStorageReader):
        def read_data(self, plan, planner):
            for req in plan.items:
                where = self.storage_data[req.storage_index]
                target = planner.resolve_tensor(req).detach()
                spans = [slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths)]
                rows = req.lengths[0] if spans else 1
                row_bytes = max(1, math.prod(req.lengths[1:])) * where.dtype.itemsize
                step = max(1, READ_CHUNK // row_bytes)
                for a in range(0, rows, step):
                    b = min(rows, a + step)
                    part = (slice(spans[0].start + a, spans[0].start + b), *spans[1:]) if spans else ()
                    with safe_open(where.relative_path, framework="pt") as f:
                        piece = f.get_slice(req.storage_index.fqn)[part]
                        (target[a:b] if spans else target).copy_(piece)
                        del piece
                planner.commit_tensor(req, target)
            done = Future()
            done.set_result(None)
            return done

    return ChunkedReader(str(folder))


def _only_weight_files(folder: Path) -> bool:
    """The folder's safetensors are exactly the model's weight files (DCP's reader reads every
    *.safetensors it finds; a stray file beside them, which from_pretrained would ignore, must not
    be read as weights): those its index names, or model.safetensors alone."""
    present = {p.name for p in folder.glob("*.safetensors")}
    try:
        named = set(json_loads((folder / INDEX).read_text())["weight_map"].values()) \
            if (folder / INDEX).is_file() else {SINGLE}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # the broadcast path names the damage
        return False
    return present == named


def _opens(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # SafetensorError, OSError
        return False


def _check_castable(params: dict, stored) -> None:
    """Every tensor in the files has its parameter's shape and a dtype the read can cast to the
    parameter's (floating point into floating point, else the same): else one line naming the
    file, the same on every rank (each read the same headers) before anything is allocated."""
    from shardtune.errors import UserError

    where = {index.fqn: info.relative_path for index, info in stored.storage_data.items()}
    for key, meta in sorted(stored.state_dict_metadata.items()):
        if key not in params:  # a part of the model is being read (export: one output file)
            continue
        want, have = params[key], meta.properties.dtype
        castable = have == want.dtype or (have.is_floating_point and want.dtype.is_floating_point)
        problem = (f"holds {key} as {str(have).removeprefix('torch.')}, which cannot be cast to the model's "
                   f"{str(want.dtype).removeprefix('torch.')}") if not castable else \
            f"holds {key} with shape {list(meta.size)}, not the model's {list(want.shape)}" \
            if tuple(meta.size) != tuple(want.shape) else None
        if problem:
            raise UserError(f"weights file {where[key]!r} {problem}; re-download or re-export the model")


def read_safetensors_into(state: dict, folder: Path, no_dist: bool = False) -> set[str]:
    """Fill `state` (plain tensors in one process, or DTensors: collective) from the folder's
    safetensors by key, cast, a chunk of rows at a time; returns the keys of `state` that the
    files lack (tied copies the caller expects). Raises UserError naming a file that is missing
    from the index, damaged, or holds a tensor that cannot be cast."""
    from torch.distributed.checkpoint import load

    from shardtune.errors import UserError, first_line

    if not _only_weight_files(folder):
        raise UserError(f"{str(folder)!r} lacks weight files its {INDEX} names, or holds others; restore the folder")
    reader = _chunked_reader(folder)
    try:
        stored = reader.read_metadata()
    except Exception as exc:  # safetensors' own errors for a truncated or damaged file: which one
        bad = next((p for p in sorted(folder.glob("*.safetensors")) if not _opens(p)), folder)
        raise UserError(f"weights file {str(bad)!r} is truncated or damaged ({first_line(exc, 100)}); "
                        "restore it, or use another checkpoint") from None
    present = {k: v for k, v in state.items() if k in stored.state_dict_metadata}
    _check_castable(present, stored)
    load(present, storage_reader=reader, no_dist=no_dist)
    return set(state) - set(present)


def load_hf_sharded(model, hf_config, folder: Path, device, trust_remote_code: bool = False,
                    params_on_host: bool = False) -> bool:
    """Collective: give the sharded meta `model` storage (`hf.allocate`) and read each rank's slices
    from `folder`. False (nothing changed) when the folder's keys are not the model's (a shard
    named by the index but missing, a stray file, key renames) or a file's header cannot be read."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from shardtune.model.hf import allocate, place_buffers

    if not _only_weight_files(folder):
        return False
    reader = _chunked_reader(folder)
    try:
        stored = reader.read_metadata()
    except Exception:  # a truncated or foreign file: the broadcast path names it in one line
        return False
    plan = hf_file_plan(hf_config, model.state_dict(), "2GB")  # DTensor shapes are the global ones
    if plan is None or set(plan[1]) != set(stored.state_dict_metadata):
        return False
    _check_castable(model.state_dict(), stored)
    allocate(model, device, params_on_host)
    state = get_model_state_dict(model)
    load({k: state[k] for k in plan[1]}, storage_reader=reader)
    place_buffers(model, device)
    buffers = _buffers_of(hf_config, trust_remote_code)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(device))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    dist.barrier()
    return True


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def file_layout(state_dict: dict, keys: list[str]) -> tuple[bytes, dict[str, int], int]:
    """(the safetensors header of a file holding `keys`, {key: byte offset of its data in the
    file}, the file's size): the format's 8-byte length + JSON (padded to 8 bytes, as safetensors' own writer
    does), the tensors' data after it in this order. The same on every rank."""
    entries, offsets, at = {"__metadata__": {"format": "pt"}}, {}, 0
    for k in keys:
        t = state_dict[k]
        size = t.numel() * t.element_size()
        entries[k] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        offsets[k], at = at, at + size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = struct.pack("<Q", len(text)) + text
    return header, {k: len(header) + off for k, off in offsets.items()}, len(header) + at


def write_rows(fd: int, path: Path, at: int, rows: torch.Tensor) -> None:
    """`rows` (any device) to byte `at` of the open file, WRITE_CHUNK bytes at a time."""
    rows = rows.detach().contiguous().reshape(-1)
    step = max(1, WRITE_CHUNK // max(1, rows.element_size()))
    with naming(path):
        for a in range(0, rows.numel(), step):
            data = memoryview(rows[a:a + step].cpu().view(torch.uint8).numpy())
            while data:
                n = os.pwrite(fd, data, at)
                data, at = data[n:], at + n


@contextlib.contextmanager
def naming(path: Path):
    """An OSError from a write (a full disk says "No space left on device" and no file) names
    `path`, so the CLI's one line says which file could not be written."""
    try:
        yield
    except OSError as exc:
        if exc.filename or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def create_safetensors(path: Path, header: bytes, offsets: dict[str, int], size: int) -> None:
    """The file at its full size: the header, then room for the data (write_rows fills it)."""
    with naming(path), open(path, "wb") as f:
        f.write(header)
        f.truncate(size)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` as one safetensors file, tensor by tensor (no copy of the file in memory; a
    failure such as a full disk is an OSError naming the file)."""
    header, offsets, size = file_layout(tensors, sorted(tensors))
    create_safetensors(path, header, offsets, size)
    fd = os.open(path, os.O_WRONLY)
    try:
        for key, at in offsets.items():
            write_rows(fd, path, at, tensors[key])
    finally:
        os.close(fd)


def write_index_and_configs(out: Path, shell, file_of: dict[str, str], hf_config, tokenizer, generation=None) -> None:
    """Beside the weight files: the index (more than one file), configs (`generation`: the generation
    config, else derived from hf_config), tokenizer."""
    _write_index(out, shell, file_of)
    _write_configs(shell, hf_config, tokenizer, out, generation)


def _write_index(out: Path, shell, file_of: dict[str, str]) -> None:
    """One file: named model.safetensors, no index (as save_pretrained); else the index."""
    names = set(file_of.values())
    if names == {SINGLE}:
        return
    sizes = dict(shell.state_dict())
    total = sum(sizes[k].numel() * sizes[k].element_size() for k in file_of)
    count = sum(sizes[k].numel() for k in file_of)
    index = {"metadata": {"total_parameters": count, "total_size": total}, "weight_map": dict(sorted(file_of.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_configs(shell, hf_config, tokenizer, out: Path, generation=None) -> None:
    """config.json, generation_config.json and the tokenizer, as save_pretrained writes them."""
    from transformers import GenerationConfig

    from shardtune.model.files import save_model_code

    shell.config.dtype = str(shell.dtype).split(".")[1]
    shell.config.architectures = [type(shell).__name__]
    shell.config.save_pretrained(out)
    save_model_code(shell.config, out)
    if generation is not None or shell.generation_config is None:
        shell.generation_config = generation or GenerationConfig.from_model_config(hf_config)
    if shell.can_generate():
        shell.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
