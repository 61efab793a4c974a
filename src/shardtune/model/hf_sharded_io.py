"""Hugging Face safetensors read by every rank for its own shards (issue 22), and the file
layout `save_pretrained` gives a state dict (shared with checkpoint.hf_sharded, the writer).

`load_hf_sharded` fills an FSDP2-sharded meta model through DCP's `HuggingFaceStorageReader`:
each rank reads only the slices it owns, cast to the parameters' dtype on the way in. Where
that cannot be done (no local safetensors folder, checkpoint keys that differ from the module
names) it returns False and the caller keeps rank 0's load + broadcast.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def hf_file_plan(hf_config, state_dict: dict, max_shard_size: str) -> tuple[object, dict[str, str]] | None:
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


def load_hf_sharded(model, hf_config, folder: Path, device, trust_remote_code: bool = False) -> bool:
    """Collective: give the sharded meta `model` storage on `device` and read each rank's slices
    from `folder`. False (nothing changed) when the folder's keys are not the model's (a shard
    named by the index but missing, key renames) or a file's header cannot be read."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    try:
        in_files = set(HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata)
    except Exception:  # a truncated or foreign file: the broadcast path names it in one line
        return False
    plan = hf_file_plan(hf_config, model.state_dict(), "2GB")  # DTensor shapes are the global ones
    if plan is None or set(plan[1]) != in_files:
        return False
    model.to_empty(device=device)
    state = get_model_state_dict(model)
    load({k: state[k] for k in plan[1]}, storage_reader=HuggingFaceStorageReader(str(folder)))
    buffers = _buffers_of(hf_config, trust_remote_code)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(device))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    dist.barrier()
    return True


def write_index_and_configs(out: Path, shell, file_of: dict[str, str], hf_config, tokenizer) -> None:
    """Beside the weight files: the index (more than one file), configs, tokenizer."""
    _write_index(out, shell, file_of)
    _write_configs(shell, hf_config, tokenizer, out)


def _write_index(out: Path, shell, file_of: dict[str, str]) -> None:
    """One file: named model.safetensors, no index (as save_pretrained); else the index."""
    names = set(file_of.values())
    if names == {SINGLE}:
        return
    sizes = dict(shell.state_dict())
    total = sum(sizes[k].numel() * sizes[k].element_size() for k in file_of)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_configs(shell, hf_config, tokenizer, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer, as save_pretrained writes them."""
    from transformers import GenerationConfig

    shell.config.dtype = str(shell.dtype).split(".")[1]
    shell.config.architectures = [type(shell).__name__]
    shell.config.save_pretrained(out)
    if shell.generation_config is None:
        shell.generation_config = GenerationConfig.from_model_config(hf_config)
    if shell.can_generate():
        shell.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
