"""A run's final/ folder: a plain Hugging Face model (a peft run's: its adapter), written whole or
not at all, by every rank together (checkpoint.sharded_final) or gathered to rank 0."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch.distributed as dist

from shardtune.checkpoint.export import gather_full_state_dict, save_adapter_folder, save_hf_folder
from shardtune.checkpoint.folders import FINAL_RECORD
from shardtune.checkpoint.hf_sharded import save_hf_sharded
from shardtune.fsio import atomic_dir


def write_final_record(folder: Path, step: int | None) -> None:
    """final/'s step, beside its weights: a run folder's final/ is what every command reads unless a
    checkpoint of a later step exists (checkpoint.folders.run_weights), which only this tells."""
    if step is not None:
        (folder / FINAL_RECORD).write_text(json.dumps({"step": step}) + "\n")


def save_final(model, cfg, hf_config, tokenizer, folder: Path, is_main: bool, generation=None,
               step: int | None = None) -> str | None:
    """A run's final/ from its sharded model, on every rank together: written by all ranks with
    checkpoint.sharded_final (returns how), else gathered to rank 0's CPU and written there.
    `generation`: the model's generation config (model.hf.load_generation_config); `step`: the
    step of its weights (written into it, write_final_record)."""
    if cfg.checkpoint.sharded_final and not cfg.peft.adapter:  # peft: the adapter, below
        return save_final_sharded(model, hf_config, tokenizer, folder, generation=generation, step=step)
    full = gather_full_state_dict(model)
    if is_main:
        with atomic_dir(folder, replace=True) as tmp:  # final/ appears only once complete
            if cfg.peft.adapter:
                save_adapter_folder(full, model, cfg.model, cfg.peft, hf_config, tokenizer, tmp, final=folder,
                                    generation=generation)
            else:
                save_hf_folder(full, hf_config, tokenizer, tmp, generation=generation)
            write_final_record(tmp, step)
    del full
    return None


@contextlib.contextmanager
def shared_atomic_dir(final: Path):
    """`fsio.atomic_dir` for a folder every rank writes into: rank 0 owns the temporary sibling
    and publishes it only when every rank got through the block; any failure removes it."""
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


def save_final_sharded(model, hf_config, tokenizer, folder: Path, max_shard_size: int | str = "2GB",
                       generation=None, step: int | None = None) -> str:
    """Collective: `folder` written by every rank (atomically); a model whose keys transformers
    renames on save is gathered to rank 0 instead. Returns which path wrote it."""
    how = "sharded"
    with shared_atomic_dir(folder) as tmp:
        if not save_hf_sharded(model, hf_config, tokenizer, tmp, max_shard_size, generation):
            how, full = "gathered", gather_full_state_dict(model)
            if dist.get_rank() == 0:
                save_hf_folder(full, hf_config, tokenizer, tmp, max_shard_size, generation)
        if dist.get_rank() == 0:  # after every collective, as rank 0's own writes are
            write_final_record(tmp, step)
    return how
