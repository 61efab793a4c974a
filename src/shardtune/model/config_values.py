"""A model config's values checked by their names, wherever they are set (model.config, a model
folder's config.json): the sizes a model needs at least one of, and the fields whose name says
their range (dropout probabilities, rotary bases and scaling factors, norm epsilons). Each
refusal names the key to set, or the file to correct."""

from __future__ import annotations

import re
from pathlib import Path

from shardtune.config.schema import ModelConfig
from shardtune.errors import UserError, first_line
from shardtune.families import HEADS, HIDDEN, LAYERS, config_field, text_config

# sizes a model needs at least 1 of, and what it has none of with 0
SIZES = ((("vocab_size",), "vocabulary"), (LAYERS, "decoder blocks"), (HIDDEN, "hidden units"),
         (HEADS, "attention heads"))


def check_sizes(hf_config, cfg: ModelConfig) -> None:
    """A size below 1 is refused by every command, naming where it is set: `n_layer: 0` builds a
    model with no decoder block (nothing to fine-tune; it generates from its embeddings alone), a
    `vocab_size: 0` an empty embedding (torch warns, then the weights do not fit)."""
    for names, lacks in SIZES:
        found = config_field(hf_config, *names)
        if found is None or found[1] >= 1:
            continue
        aliases = {**getattr(hf_config, "attribute_map", {}), **getattr(text_config(hf_config), "attribute_map", {})}
        name, value = aliases.get(found[0], found[0]), found[1]  # as config.json names it: n_layer for GPT-2
        given = next((k for k, v in cfg.config.items() if aliases.get(k, k) == name and v == value), None)
        if cfg.name_or_path is None or given is not None:
            key = given or name
            raise UserError(f"model.config.{key}={value} leaves the model with no {lacks}; set "
                            f"model.config.{key} to 1 or more")
        raise UserError(f"{name}={value} in {_origin(cfg)} leaves the model with no {lacks}; use another model, or "
                        f"correct {name} in its config.json")


# config fields by name, with the values they can take: transformers checks few of them (a rope
# factor below 1 it only warns about), and a value out of range builds, then fails mid-step (torch's
# dropout refuses p > 1) or trains on garbage or NaN from step 1 (a rotary base of 0 or less, a
# scaling factor below 1, a negative norm epsilon). (pattern on the dotted name, allowed, what the
# field is, the range said in the fix)
RANGES = (
    (re.compile(r"dropout|pdrop|layerdrop|drop_path"), lambda v: 0 <= v <= 1, "a dropout probability",
     "a value from 0 to 1 (0: no dropout)"),
    (re.compile(r"(^|\.)rope_theta$"), lambda v: v > 0, "a rotary base", "a value above 0 (10000 is usual)"),
    (re.compile(r"(^|\.)(rope_scaling|rope_parameters)\.factor$"), lambda v: v >= 1, "a rotary scaling factor",
     "a value of 1 or more (1: no scaling)"),
    (re.compile(r"(^|_)eps(ilon)?$"), lambda v: v >= 0, "a norm's epsilon", "a small value of 0 or more (1e-5)"),
)


def check_ranges(hf_config, cfg: ModelConfig) -> None:
    """A config field out of the range its name says (RANGES), in the config or any of its
    sub-configs, refused naming where it is set."""
    found = next(_out_of_range(config_dict(hf_config, cfg)), None)
    if found is None:
        return
    name, value, (_, _, what, fix) = found
    if cfg.name_or_path is None or name.split(".")[-1] in cfg.config or name in cfg.config:
        raise UserError(f"model.config.{name}={value} is {what} out of range; set model.config.{name} to {fix}")
    raise UserError(f"{name}={value} in {_origin(cfg)} is {what} out of range; correct it in its config.json, or set "
                    f"model.config.{name} to {fix}")


def config_dict(hf_config, cfg: ModelConfig) -> dict:
    """The config as its config.json holds it. transformers takes some values it cannot write
    (`quantization_config: 0`, `dtype: [1]`); every save writes this, and the checks read it, so
    such a value is refused here (a traceback before), naming its key where model.config set it."""
    try:
        hf_config.to_json_string(use_diff=False)  # what a save writes (to_dict, then JSON)
        return hf_config.to_dict()
    except Exception as exc:  # noqa: BLE001 - whichever a config class raises on a value of the wrong type
        why = f"{type(exc).__name__}: {first_line(exc, 120)}"
    key = next((k for k, v in cfg.config.items() if not _writable(hf_config, k, v)), None)
    if key is not None:
        raise UserError(f"model.config.{key}={cfg.config[key]!r} is a value transformers cannot write to a "
                        f"config.json ({why}); give {key} the type it takes, or drop it")
    if cfg.name_or_path is None or cfg.config:
        raise UserError(f"model.config makes a config transformers cannot write ({why}); check the types of its values")
    raise UserError(f"{_origin(cfg)} holds a value transformers cannot write back ({why}); correct it in its "
                    "config.json")


def _writable(hf_config, key: str, value) -> bool:
    """Whether the default config of hf_config's type, with key=value alone, writes (a refusal's key)."""
    try:
        type(hf_config)(**{key: value}).to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - as config_dict
        return False
    return True


def _out_of_range(tree: dict, prefix: str = ""):
    """(dotted name, value, rule) of each number out of its field's range in a config's dict."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _out_of_range(value, name + ".")
            continue
        numbers = [v for v in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for rule in RANGES:
            if rule[0].search(name) and not all(rule[1](v) for v in numbers):
                yield name, value, rule


def _origin(cfg: ModelConfig) -> str:
    """Where a model folder's config comes from, for a refusal: its config.json, or its name."""
    file = Path(cfg.name_or_path) / "config.json"
    return repr(str(file)) if file.is_file() else f"the config of model {cfg.name_or_path!r}"
