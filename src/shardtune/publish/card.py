"""The model card (README.md) uploaded with a run's final model: what it was trained from and
on, how, how well, and the command that trains it again."""

from __future__ import annotations

import json

from shardtune.config.schema import ModelConfig, PeftConfig, known_fields
from shardtune.names import hub_id
from shardtune.publish.adapter_base import adapter_hub_base, hub_base


def model_card(cfg: dict, step: int, evals: dict | None, config_name: str = "shardtune_config.yaml") -> str:
    """Markdown with a YAML header; `cfg` is RunConfig.to_dict(), `evals` the final eval numbers."""
    from shardtune import __version__

    model, data, train, peft = cfg["model"], cfg["data"], cfg["train"], cfg["peft"]
    # the hub id the uploaded adapter config names, also for a local copy of a hub model (adapter_base.py)
    model_cfg, peft_cfg = known_fields(ModelConfig, model), known_fields(PeftConfig, peft)
    base = (adapter_hub_base(model_cfg, peft_cfg) if peft_cfg.adapter else hub_base(model_cfg))[0]
    dataset = hub_id(data.get("path"))
    method = peft.get("method", "none")
    # fresh weights, as model.hf.load_source_model builds them: no name_or_path, or random_init with one
    scratch = model_cfg.random_init or not model_cfg.name_or_path
    header = ["---", f"library_name: {'peft' if method != 'none' else 'transformers'}", "tags:", "- shardtune",
              "- trained-from-scratch" if scratch else "- fine-tuned"]
    if base:
        header.append(f"base_model: {json.dumps(base)}")
    if dataset:
        header += ["datasets:", f"- {json.dumps(dataset)}"]
    header.append("---")
    kind = (model.get("config") or {}).get("model_type", "")
    source = base or model_cfg.name_or_path
    if scratch:  # never "trained from gpt2" for fresh weights of gpt2's config
        source = " ".join(filter(None, ["a randomly initialised", kind, "model"])) + (
            f" of {model_cfg.name_or_path}'s config" if model_cfg.name_or_path else "")
    named = {"lora": "LoRA", "dora": "DoRA", "ia3": "IA3", "adaption_prompt": "LLaMA-Adapter"}.get(method, method)
    what = f"{named} adapter" if method != "none" else "model"
    what = ("An " if what[0] in "AEIOU" else "A ") + what
    lines = [*header, "", f"# {cfg.get('publish', {}).get('hub_repo') or 'shardtune model'}", "",
             f"{what} trained from **{source}** on **{data.get('path')}** ({data.get('format')} format, "
             f"sequences of {data.get('seq_len')} tokens) for {step} optimizer steps with "
             f"[shardtune](https://pypi.org/project/shardtune/) {__version__}: learning rate {train.get('lr')}, "
             f"global batch {train.get('global_batch_size')} sequences, precision {cfg.get('precision')}"
             + (f", {named} r={peft.get('r')} alpha={peft.get('alpha')}" if method in ("lora", "dora") else "")
             + ".", ""]
    if evals:
        lines += ["## Evaluation (held-out split, end of training)", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in evals.items() if isinstance(v, (int, float))]
        lines.append("")
    lines += ["## Checkpoints", "",
              "Intermediate checkpoints, when published, are in `checkpoints/step-N/` (each a loadable folder).", "",
              "## Reproduce", "", "The full recipe is in "
              f"[`{config_name}`]({config_name}); with its data and model at the same paths:", "", "```",
              f"pip install shardtune=={__version__}",
              f"shardtune train {config_name} output_dir=runs/reproduce publish.hub_repo=null", "```", ""]
    return "\n".join(lines)
