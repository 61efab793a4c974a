"""final/ written by every rank together in Hugging Face's format, no rank holding a full copy.

Each rank writes its own shards through DCP's `HuggingFaceStorageWriter`; the shards are then
consolidated (torch's safetensors consolidation, output files spread over the ranks) into the
layout `save_pretrained` writes: the same file names, the same split over files, the same keys
(a tied head written once), `model.safetensors.index.json` when there is more than one file.
The output folder must be on a file system that every rank sees (shared across nodes).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.model.hf_sharded_io import hf_file_plan, write_index_and_configs

SHARDS = ".rank-shards"  # DCP's per-rank files, inside the folder being written; removed when done


def _shard_index(name: str, files: list[str]) -> int:
    return files.index(name) + 1


def save_hf_sharded(model, hf_config, tokenizer, out: Path, max_shard_size: str = "2GB") -> bool:
    """Collective: every rank writes its part of `model` (FSDP2-sharded) into `out` (the same
    path on every rank, an existing empty folder). Returns False, having written nothing, when
    the model's keys cannot be written this way (the caller gathers instead)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save
    from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state_dict = get_model_state_dict(model)
    plan = hf_file_plan(hf_config, state_dict, max_shard_size)
    if plan is None:
        return False
    shell, file_of = plan
    files = sorted(set(file_of.values()))
    index = {k: _shard_index(name, files) for k, name in file_of.items()}
    shards = out / SHARDS
    writer = HuggingFaceStorageWriter(str(shards), fqn_to_index_mapping=index, save_distributed=True)
    save({k: state_dict[k] for k in file_of}, storage_writer=writer)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {k: name for k, name in file_of.items() if (_shard_index(name, files) - 1) % world == rank}
    # each rank consolidates its own output files (rank r: files r, r+N, ...), then rank 0 the rest
    together(lambda: _consolidate_safetensors_files(str(shards), str(out), mine, num_threads=1) if mine else None)
    together(lambda: _finish(out, shards, shell, file_of, hf_config, tokenizer) if rank == 0 else None)
    return True


def together(step) -> None:
    """Collective: run `step` on every rank; if it fails on any, it fails on all (the failing
    rank raises its own error, the others a line saying so) instead of leaving them waiting."""
    failed = torch.zeros(1)
    try:
        step()
    except BaseException:
        failed += 1
        raise
    finally:
        dist.all_reduce(failed)
    if failed.item():
        raise RuntimeError("another rank failed writing its part of the model folder")


def _finish(out: Path, shards: Path, shell, file_of: dict[str, str], hf_config, tokenizer) -> None:
    shutil.rmtree(shards)
    write_index_and_configs(out, shell, file_of, hf_config, tokenizer)


@contextlib.contextmanager
def shared_atomic_dir(final: Path):
    """`fsio.atomic_dir` for a folder every rank writes into: rank 0 owns the temporary sibling
    and publishes it only when every rank got through the block; any failure removes it."""
    from shardtune.fsio import atomic_dir

    main = dist.get_rank() == 0
    box: list = [None]
    if main:
        ctx = atomic_dir(final, replace=True)
        try:
            box = [str(ctx.__enter__())]
        finally:
            dist.broadcast_object_list(box, src=0)  # None tells the others rank 0 could not start
    else:
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise RuntimeError(f"rank 0 could not create the folder for {final}")
    try:
        yield Path(box[0])
        dist.barrier()  # every rank finished writing
    except BaseException as exc:
        if main:
            ctx.__exit__(type(exc), exc, exc.__traceback__)
        raise
    if main:
        ctx.__exit__(None, None, None)


def save_final_sharded(model, hf_config, tokenizer, folder: Path, max_shard_size: str = "2GB") -> str:
    """Collective: `folder` written by every rank (atomically); a model whose keys transformers
    renames on save is gathered to rank 0 instead. Returns which path wrote it."""
    from shardtune.checkpoint.export import gather_full_state_dict, save_hf_folder

    with shared_atomic_dir(folder) as tmp:
        if save_hf_sharded(model, hf_config, tokenizer, tmp, max_shard_size):
            return "sharded"
        full = gather_full_state_dict(model)
        if dist.get_rank() == 0:
            save_hf_folder(full, hf_config, tokenizer, tmp, max_shard_size)
    return "gathered"
