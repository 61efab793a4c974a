"""A run's final/ folder: a plain Hugging Face model (a peft run's: its adapter), written whole or
not at all, by every rank together (checkpoint.sharded_final) or gathered to rank 0."""

from __future__ import annotations

from pathlib import Path

from shardtune.checkpoint.export import gather_full_state_dict, save_adapter_folder, save_hf_folder
from shardtune.checkpoint.hf_sharded import save_final_sharded
from shardtune.fsio import atomic_dir


def save_final(model, cfg, hf_config, tokenizer, folder: Path, is_main: bool) -> str | None:
    """A run's final/ from its sharded model, on every rank together: written by all ranks with
    checkpoint.sharded_final (returns how), else gathered to rank 0's CPU and written there."""
    if cfg.checkpoint.sharded_final and not cfg.peft.adapter:  # peft: the adapter, below
        return save_final_sharded(model, hf_config, tokenizer, folder)
    full = gather_full_state_dict(model)
    if is_main:
        with atomic_dir(folder, replace=True) as tmp:  # final/ appears only once complete
            if cfg.peft.adapter:
                save_adapter_folder(full, model, cfg.model, cfg.peft, hf_config, tokenizer, tmp, final=folder)
            else:
                save_hf_folder(full, hf_config, tokenizer, tmp)
    del full
    return None
