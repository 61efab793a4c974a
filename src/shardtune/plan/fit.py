"""Where the planner finds a model's transformers config without the network, and what one
config needs on its own device (the fit checks of `train`/`sweep`: the predicted peak, the
largest micro-batch that fits, for train.micro_batch_size=auto)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardtune.config.schema import ModelConfig, RunConfig
from shardtune.errors import UserError

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"




def resolve_hf_config(cfg: RunConfig):
    """(transformers config, where it came from), without the network: model.config, a local
    folder, the Hugging Face cache, or a config shipped with shardtune for the recipes' models."""
    from shardtune.model.hf import load_hf_config

    m = cfg.model
    if m.name_or_path is None:  # as train builds it: the vocabulary of its tokenizer, where that is at hand
        from shardtune.model.hf import load_tokenizer, match_tokenizer

        hf_config = load_hf_config(m)
        try:
            match_tokenizer(hf_config, load_tokenizer(m), m)
        except UserError:
            return hf_config, "model.config (tokenizer not at hand: the config's vocabulary)"
        return hf_config, "model.config"
    if Path(m.name_or_path).is_dir():
        return load_hf_config(m), f"local folder {m.name_or_path}"
    try:
        return load_hf_config(m, local_files_only=True), "the Hugging Face cache"
    except UserError:
        pass
    shipped = SHIPPED_CONFIGS / f"{m.name_or_path.replace('/', '--')}.json"
    if shipped.is_file():
        whole = {**json.loads(shipped.read_text()), **m.config}
        local = ModelConfig(config=whole, trust_remote_code=m.trust_remote_code)
        return load_hf_config(local), f"the copy of its config.json shipped with shardtune ({shipped.name})"
    raise UserError(f"the config of model {m.name_or_path!r} is not available offline (not a local folder, not in "
                    f"the Hugging Face cache); run `shardtune download model:{m.name_or_path}` where there is "
                    "network, or give model.config={model_type: ..., ...}")


def trace_target(cfg: RunConfig) -> str:
    """'cuda' where the run would use a GPU (device=cuda, or auto with one visible), else 'cpu'."""
    if cfg.device == "auto":

        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def predict_peak_bytes(cfg: RunConfig, world_size: int) -> int:
    """Predicted peak bytes of live tensors on one rank for exactly this config on its device:
    on CPU the traced peak; on CUDA the traced peak of GPU-resident tensors plus the cuBLAS
    workspace (what torch.cuda.max_memory_allocated would report). For sweep's max-batch search."""
    from shardtune.plan.trace import trace_step

    hf_config, _ = resolve_hf_config(cfg)
    target = trace_target(cfg)
    trace = trace_step(cfg, hf_config, world_size, target=target)
    if target == "cpu":
        return trace.peak_bytes()
    from shardtune.plan.cost import gpu_memory

    return gpu_memory(trace, cfg.fsdp.cpu_offload, world_size)["allocated"]
