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


def with_base(adapter_config: Path, base: str) -> bytes:
    """`adapter_config.json`'s text with `base_model_name_or_path` set to `base`."""
    config = json_loads(adapter_config.read_text())
    config["base_model_name_or_path"] = base
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def export_base(checkpoint: str, say=print) -> str | None:
    """The hub id that `shardtune export CHECKPOINT --push-to-hub` names in the Hub copy of the
    exported adapter's config, as a run's publisher does (None: no adapter, or a residual base
    (PiSSA/OLoRA) uploaded in base/, or no hub id known: then `say` tells why)."""
    from shardtune.checkpoint.folders import read_meta, resolve_checkpoint
    from shardtune.config.schema import ModelConfig, PeftConfig, known_fields

    config = read_meta(resolve_checkpoint(checkpoint))["config"]
    peft = known_fields(PeftConfig, config.get("peft", {}))
    if not peft.adapter or peft.residual_init:
        return None
    base, warning = hub_base(known_fields(ModelConfig, config.get("model", {})))
    if warning:
        say(warning)
    return base
