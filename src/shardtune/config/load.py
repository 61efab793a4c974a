"""Recipes to `RunConfig`: a YAML recipe plus dotted `key=value` overrides.

A recipe is plain data. `load_config` merges the recipe with the overrides, checks every key
and type (unknown keys get a "did you mean" suggestion), validates what needs only the config
(`shardtune.config.validation`) and returns a `RunConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from shardtune.config.recipe_yaml import Dumper, Written, YAMLSyntaxError, load_yaml
from shardtune.config.schema import PATH_KEYS, RunConfig
from shardtune.config.validation import validate
from shardtune.errors import UserError, first_line

INPUT_KEYS = frozenset({"model.name_or_path", "model.tokenizer", "data.path"})  # read by a run, never written


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=3e-5` -> ("train.lr", 3e-05 as Written: its text kept). Values are parsed as YAML
    scalars/lists, as in a recipe."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"override {text!r} is not key=value; write it like train.lr=3e-5")
    try:
        value = load_yaml(raw, f"the value of {key}") if raw != "" else None
    except YAMLSyntaxError:
        value = raw
    if not isinstance(value, (str, type(None), bool, int, float)):  # a number or date is a Written already
        value = Written(_value_text(raw), value)  # `data.template=Q: {q}` reads as YAML but is meant as text
    return key.strip(), value


def _value_text(raw: str) -> str:
    """The text of the value YAML read from `raw`, without a trailing comment: `{q}  # note` is `{q}`
    for a key typed as text, as `runs/x  # note` (a plain text) and every recipe line already were."""
    node, seen = yaml.compose(raw, Loader=yaml.SafeLoader), set()
    if node is None:
        return raw
    # a block mapping's or list's end mark lies past its comment: its last value's is the end
    while not (isinstance(node, yaml.ScalarNode) or node.flow_style or not node.value or id(node) in seen):
        seen.add(id(node))  # an alias of a list inside itself
        last = node.value[-1]
        node = last[1] if isinstance(last, tuple) else last
    return raw[:node.end_mark.index]


def override_word(key: str, text: str) -> str:
    """The `key=text` word that `parse_override` reads back as `text`, for a value shardtune hands on
    (the output folder of its ranks, trials, Slurm job): YAML read `runs/exp #2` as runs/exp (a
    comment) and `no` as false, so such a text goes double-quoted."""
    word = f"{key}={text}"
    if parse_override(word)[1] == text:  # a Written number compares as its text
        return word
    return f"{key}={yaml.safe_dump(text, default_style=chr(34), width=float('inf'), allow_unicode=True).strip()}"


def _plain(value: Any) -> Any:
    """A free-form value (model.config) with the overrides inside it as YAML read them:
    `model.config.rope_scaling={type: linear, factor: 2}` a mapping, not its text."""
    if isinstance(value, Written):  # a date as written (`2024-01-01`, as JSON and YAML 1.2 read it), not a date
        return str(value) if isinstance(value.parsed, datetime.date) else _plain(value.parsed)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, list) else value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """`key`'s value put into `tree`, making the mappings above it. One above it that holds
    something else is refused: replaced, `train=1 train.lr=1e-3` trained without a word about
    train=1 (an empty YAML section, None, is a mapping to come)."""
    node = tree
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1], 1):
        child = node.get(part)
        if isinstance(child, Written) and isinstance(child.parsed, dict):
            child = node[part] = child.parsed
        if child is not None and not isinstance(child, dict):
            raise UserError(f"cannot set {key}: {'.'.join(parts[:depth])} is {_short(child)}, not a mapping")
        if child is None:
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def _one_spelling(tree: dict, key: str) -> str:
    """`key` under its field's own name (checkpoint.async -> checkpoint.async_save), with any other
    spelling of it dropped from `tree`: an override replaces the recipe's value however either spells
    it (the recipe's `async:` after it won, without a word)."""
    cls, node, parts = RunConfig, tree, key.split(".")
    for i, part in enumerate(parts):
        if not (dataclasses.is_dataclass(cls) and isinstance(node, dict)):
            break
        aliases = getattr(cls, "KEY_ALIASES", {})
        parts[i] = name = aliases.get(part, part)
        if i == len(parts) - 1:
            for other in (a for a, field in aliases.items() if field == name):
                node.pop(other, None)
            break
        cls, node = typing.get_type_hints(cls).get(name), node.get(name, node.get(part))
    return ".".join(parts)


def load_config(recipe: str | Path | None, overrides: list[str] | None = None,
                defaults: dict | None = None) -> RunConfig:
    """Recipe YAML (or `defaults` when there is none) + dotted overrides -> checked RunConfig."""
    if defaults is not None and not isinstance(defaults, dict):  # a caller's slip, e.g. (defaults, line)
        raise TypeError(f"load_config's defaults must be a mapping, got {type(defaults).__name__}")
    tree: dict = copy.deepcopy(defaults or {})  # the overrides go in: the caller's stays as it was
    name = None
    if recipe is not None:
        path = Path(recipe)
        if path.is_dir():
            raise UserError(f"recipe {str(path)!r} is a folder; give the path to a YAML file (see recipes/)")
        if not path.is_file():
            raise UserError(f"recipe {str(path)!r} not found; give the path to a YAML file (see recipes/)")
        loaded = load_yaml(_recipe_text(path), f"recipe {str(path)!r}", "fix the file") or {}
        if not isinstance(loaded, dict):
            raise UserError(f"recipe {str(path)!r} must be a mapping of keys to values")
        tree = loaded
        name = path.stem
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(tree, _one_spelling(tree, key), value)
    cfg = _build(RunConfig, tree, prefix="")
    if cfg.recipe is None:
        cfg.recipe = name or "quickstart"
    validate(cfg)
    return cfg


def load_saved_config(path: Path, tree: dict | None = None) -> RunConfig:
    """The config a run saved: its config.yaml at `path`, or the `tree` of a checkpoint's meta.json
    (`path`). A refusal names that file, which the user never typed: a key of another shardtune
    version, a hand edit."""
    try:
        return load_config(path if tree is None else None, None, defaults=tree)
    except UserError as exc:
        raise UserError(f"the run config saved in {str(path)!r} is not one this shardtune reads ({exc}); it was "
                        "written by another version or edited: restore it, or use the shardtune that wrote "
                        "it") from None


def _recipe_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"recipe {str(path)!r} is not a text file (byte {exc.start} is not UTF-8); give a YAML "
                        "recipe") from None
    except OSError as exc:
        raise UserError(f"recipe {str(path)!r} cannot be read ({exc.strerror}); check its permissions") from None


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise UserError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {_short(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs, spelled = {}, {}
    for key, value in data.items():
        if not isinstance(key, str):  # YAML reads `1:` or `true:` as a number or a bool
            raise UserError(f"config key {prefix}{key!r} is not a name; keys are words like "
                            f"{prefix}{next(iter(fields))}")
        written, key = key, getattr(cls, "KEY_ALIASES", {}).get(key, key)
        if key not in fields:
            raise UserError(f"unknown config key '{prefix}{key}'{_key_hint(prefix, key, fields)}")
        aliases = getattr(cls, "VALUE_ALIASES", {}).get(key, {})
        value = next((new for old, new in aliases.items() if value is old), value)
        value = _coerce(hints[key], value, f"{prefix}{key}")
        if key in spelled and kwargs[key] != value:  # `async:` and `async_save:` in one recipe: the last won
            raise UserError(f"{prefix}{spelled[key]}={_short(kwargs[key])} and {prefix}{written}={_short(value)} "
                            f"set the same key ({prefix}{key}) to different values; keep one of them")
        kwargs[key], spelled[key] = value, written
        if f"{prefix}{key}" in PATH_KEYS and isinstance(kwargs[key], str):
            kwargs[key] = _path_value(f"{prefix}{key}", kwargs[key])
    return cls(**kwargs)


def _path_value(key: str, text: str) -> str:
    """`~` is the user's home, as in a shell. An input that exists here is named from the root: the
    run's saved config is read from other working directories (`eval RUN`, `generate`, `export
    --merge`, a resume), where a relative `data.path` named nothing or another file."""
    path = os.path.expanduser(text)
    if key in INPUT_KEYS and os.path.exists(path):
        return os.path.abspath(path)
    return path


def _key_hint(prefix: str, key: str, fields) -> str:
    """The fix for an unknown key: a recipe that writes `train.lr: 1` at the top means the nested
    key (YAML reads the dot as part of the name); else the closest name, or the valid ones."""
    head, _, rest = key.partition(".")
    if rest and head in fields:
        return f"; a recipe nests keys: write {head}: then {rest}: indented below it (or pass {prefix}{key}=... " \
               "on the command line)"
    close = difflib.get_close_matches(key, fields, n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"


def _coerce(tp, value: Any, key: str):
    if isinstance(value, Written):  # the text as written for a key typed as text (`007`, not 7)
        wants_text = tp is str or str in typing.get_args(tp)
        value = str(value) if wants_text else value.parsed
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, prefix=key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except UserError as exc:
                errors.append(exc)
        words = [str(c) for a in args if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        if words and len(errors) > 1:  # e.g. int | Literal["auto"]: name both forms
            raise UserError(f"{first_line(errors[0])}, or one of: {', '.join(words)}")
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(f"{key}={_short(value)} is not a valid choice; {hint}choose one of: {', '.join(choices)}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            example = {int: "[3,5]", float: "[0.9,0.95]"}.get(inner) or (  # a list of names: the one given, listed
                f"[{value}]" if isinstance(value, str) and len(value) < 40 and value.isprintable() else "[a,b]")
            raise UserError(f"{key} must be a list, got {_short(value)}; write it like {key}={example}")
        return [_coerce(inner, v, key) for v in value]
    if tp is dict:
        if value is None:  # `config:` left empty in a recipe, or key=null: no entries
            return {}
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {_short(value)}")
        return _plain(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {_short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise UserError(f"{key} must be an integer, got {_short(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} must be a number, got {_short(value)}")
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            raise UserError(f"{key} is a number too large to use ({len(str(value))} digits)") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise UserError(f"{key} must be a string, got {_short(value)}")
        return str(value)
    raise TypeError(f"unsupported config type {tp} for {key}")


def _short(value: Any) -> str:
    """A value as shown in a one-line message: at most 80 characters, whatever its size."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"a number of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < 50 else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def check_world(cfg: RunConfig, world_size: int) -> int:
    """Gradient-accumulation steps for this world size, or a UserError if the batch does not divide."""
    t = cfg.train
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size "
            f"x ranks = {t.micro_batch_size} x {world_size}; change the batch sizes or the number of ranks")
    return t.global_batch_size // per_step


def auto_micro_batches(global_batch: int, world_size: int) -> list[int]:
    """The micro-batches that keep the global batch on `world_size` ranks: the divisors of
    global batch / ranks; a one-line error where the ranks do not divide it."""
    per_rank, rest = divmod(global_batch, world_size)
    if rest or not per_rank:
        raise UserError(f"train.micro_batch_size=auto keeps train.global_batch_size={global_batch}, which "
                        f"{world_size} ranks do not divide; set the global batch to a multiple of {world_size}")
    # divisors in pairs up to the square root: a loop to per_rank took minutes for a global batch of 1e9
    small = [m for m in range(1, math.isqrt(per_rank) + 1) if per_rank % m == 0]
    return sorted({*small, *(per_rank // m for m in small)})


def hybrid_mesh(fsdp, world: int, local_world: int) -> tuple[int, int]:
    """hybrid_shard's (replicate, shard) mesh on `world` ranks of `local_world` per node: the
    config's sizes, else a shard group per node; a one-line error where they do not make the world."""
    shard = fsdp.shard_size or (world // fsdp.replicate_size if fsdp.replicate_size else local_world)
    replicate = fsdp.replicate_size or (world // shard if shard else 0)
    if shard < 1 or replicate * shard != world:
        raise UserError(f"hybrid_shard needs replicate_size x shard_size = world size {world}, got "
                        f"{replicate} x {shard}; set fsdp.shard_size to a divisor of {world}")
    return replicate, shard


def check_job(cfg: RunConfig, world: int, local_world: int) -> None:
    """What a job of `world` ranks, `local_world` per node, needs of a loaded (unresolved) config:
    the batch divides over the ranks, and hybrid_shard's mesh makes the world. For a job written
    here and run elsewhere (`shardtune slurm`): refused now, not after the queue."""
    if cfg.train.micro_batch_size == "auto":
        auto_micro_batches(cfg.train.global_batch_size, world)
    else:
        check_world(cfg, world)
    if cfg.fsdp.sharding == "hybrid_shard":
        hybrid_mesh(cfg.fsdp, world, local_world)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.dump(cfg.to_dict(), Dumper=Dumper, sort_keys=False)
