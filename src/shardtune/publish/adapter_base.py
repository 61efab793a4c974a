"""The base model a LoRA adapter's Hub copy names. Locally the adapter config points at a folder
(the run's base/ copy, or the folder QLoRA quantized); on the Hub that path means nothing, so the
uploaded adapter_config.json names a hub id instead when one is known: the recipe's
`model.name_or_path` when it is one, else the `_name_or_path` a local base's config.json keeps
(folders saved by older transformers). With neither, the run warns once at start-up."""

from __future__ import annotations

import json
from pathlib import Path

from shardtune.fsio import json_loads
from shardtune.names import hub_id


def hub_base(model_cfg) -> tuple[str | None, str | None]:
    """(the hub id the Hub copy of the adapter config names, or None: keep the local one; a
    warning for the start of the run, or None)."""
    name = model_cfg.name_or_path
    if name and not model_cfg.random_init:
        if not Path(name).expanduser().exists():
            return hub_id(name), None
        try:
            origin = json_loads((Path(name).expanduser() / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            origin = None
        if hub_id(origin):
            return origin, None
        where = f"the local folder {name!r}, which names no hub id (config.json has no _name_or_path)"
    else:
        where = "a randomly initialised model"
    return None, (f"warning: the base model is {where}: the Hub copy of the LoRA adapter names a local "
                  "path, so loading it from the Hub needs the base from elsewhere; set model.name_or_path "
                  "to the base's hub id to publish an adapter that loads from the Hub alone")


def adapter_hub_base(model_cfg, peft_cfg) -> tuple[str | None, str | None]:
    """hub_base for an adapter run. Its base is not the hub model's when PiSSA/OLoRA left the
    residual in it, or model.config overrode the hub config (rope scaling, norm eps: the adapter on
    the hub config gives other logits): then the export saved it in base/, and the Hub copy keeps
    naming that (a loud failure on another machine, not a quietly different model)."""
    if peft_cfg.residual_init:
        why = f"peft.init={peft_cfg.init} trains against residual base weights"
    elif model_cfg.config and peft_cfg.quantize == "none" and not model_cfg.random_init:
        why = "model.config overrides the base's hub config"
    else:
        return hub_base(model_cfg)
    return None, (f"warning: {why}, uploaded in base/ beside the adapter: load the Hub copy with that "
                  "subfolder as its base, not the original model")


def with_base(adapter_config: Path, base: str) -> bytes:
    """`adapter_config.json`'s text with `base_model_name_or_path` set to `base`."""
    config = json_loads(adapter_config.read_text())
    config["base_model_name_or_path"] = base
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def export_base(checkpoint: str, say=print) -> str | None:
    """The hub id that `shardtune export CHECKPOINT --push-to-hub` names in the Hub copy of the
    exported adapter's config, as a run's publisher does (None: no adapter, or none known: then
    `say` tells why)."""
    from shardtune.checkpoint.folders import export_source, read_meta
    from shardtune.config.schema import ModelConfig, PeftConfig, known_fields

    source = export_source(checkpoint)  # the weights the export read: a run's final/ keeps no meta.json
    if source.final:
        from shardtune.config.load import load_saved_config

        cfg = load_saved_config(source.path.parent / "config.yaml")
        model, peft = cfg.model, cfg.peft
    else:
        config = read_meta(source.path)["config"]
        model = known_fields(ModelConfig, config.get("model", {}))
        peft = known_fields(PeftConfig, config.get("peft", {}))
    if not peft.adapter:
        return None
    base, warning = adapter_hub_base(model, peft)
    if warning:
        say(warning)
    return base
