"""Plain Hugging Face folders out of a sharded model."""

from __future__ import annotations

from pathlib import Path


def gather_full_state_dict(model) -> dict:
    """Full (unsharded) weights on rank 0's CPU; other ranks get {} and never hold a full copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf_folder(state_dict: dict, hf_config, tokenizer, out: Path, max_shard_size: str = "2GB") -> None:
    """Write config, safetensors weights (sharded above max_shard_size), generation config and
    tokenizer, loadable by `AutoModelForCausalLM.from_pretrained(out)` unchanged."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    shell.load_state_dict(state_dict, assign=True, strict=False)
    shell.tie_weights()
    missing = [n for n, p in shell.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"export is missing weights: {missing[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    if shell.generation_config is None:
        shell.generation_config = GenerationConfig.from_model_config(hf_config)
    shell.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
