"""A model or tokenizer as files on this machine: a folder here or a Hub id, and the folder's JSON
files and weights, each checked before a library reads it, so a damaged download is one line
naming the file rather than a library's traceback."""

from __future__ import annotations

import os
from pathlib import Path

from shardtune.errors import UserError, first_line
from shardtune.fsio import json_loads
from shardtune.names import hub_id

# The JSON files a model or tokenizer folder may hold; each is checked before a library reads it.
MODEL_JSON = ("config.json", "generation_config.json", "model.safetensors.index.json")
# a folder holds a tokenizer when it has one of these (the fast file, or a slow tokenizer's vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")


def hub_hint(name: str) -> str:
    """What to do about a Hub id that is not found: check it, or fill the cache where there is network."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return (f"HF_HUB_OFFLINE=1 and {name!r} is not in the local cache ($HF_HOME); run "
                f"`shardtune download {name}` where there is network, or give a local folder")
    return f"check the name, or give a local folder (no network? run `shardtune download {name}` where there is)"


def reason(exc: BaseException) -> str:
    """The line of a library error that says what is wrong (strict-dataclass errors put it last)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return (lines[-1] if lines[0].endswith(":") else lines[0])[:160]


def check_model_source(name: str, key: str) -> None:
    """`key` names a folder here or a Hub id: a path to a file (or FIFO, device), or a name that is
    neither (`./gone`, `/a/b`, `runs/x/final/` where that folder is not there) is refused now, the
    same for every command, rather than looked up on the Hub, whose error names something else."""
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}={name!r} is a file, not a folder; give the model's folder (with config.json) "
                        "or a hub id")
    if not path.exists() and hub_id(name) is None:
        raise UserError(f"{key}={name!r} not found: no such folder here, and not a Hub id (org/name); check "
                        "the path")
    adapter = (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()
    if key == "model.name_or_path" and adapter:
        refuse_adapter_as_model(path, key)


def refuse_adapter_as_model(path: Path, key: str) -> None:
    """A peft adapter folder is not a model to train from: it needs its base under it."""
    try:
        base = json_loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    on = f" on {base!r}" if isinstance(base, str) and base else ""
    raise UserError(f"{key}={str(path)!r} is a peft adapter folder (adapter_config.json{on}), not a model; merge it "
                    f"into its base first (`shardtune export {path} OUT --merge`, then {key}=OUT), or train a new "
                    f"adapter on the base ({key}=<the base>)")


def check_json_files(folder: Path, names: tuple[str, ...]) -> None:
    """Each of these files the folder holds must be readable JSON: one line naming the one that is not."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        read_json_object(path)


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object: one line naming it when it is unreadable, not JSON, or another type."""
    try:
        value = json_loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{str(path)!r} is damaged (not valid JSON: {first_line(exc, 100)}); re-download "
                        "or re-export the folder") from None
    except OSError as exc:
        raise UserError(f"{str(path)!r} cannot be read ({exc.strerror}); fix its permissions") from None
    if not isinstance(value, dict):
        raise UserError(f"{str(path)!r} is damaged (it holds a JSON {type(value).__name__}, not an object); "
                        "re-download or re-export the folder")
    return value


def check_model_folder(folder: Path, weights: bool = True) -> None:
    """A local model folder: config.json present and readable, and (when its weights will be read)
    every weight file present and complete (safetensors headers cover the files)."""
    if not (folder / "config.json").is_file():
        final = folder / "final"
        if (final / "config.json").is_file():  # a shardtune run of a whole model
            raise UserError(f"model folder {str(folder)!r} is a training run, not a model; give its model "
                            f"{str(final)!r}")
        raise UserError(f"model folder {str(folder)!r} has no config.json; give a Hugging Face model folder "
                        "(config.json and weights)")
    check_json_files(folder, MODEL_JSON)
    if weights:
        for path in weight_files(folder):
            check_safetensors(path)
    if (folder / "generation_config.json").is_file():  # its values are checked only after the weights load
        from transformers import GenerationConfig

        try:
            GenerationConfig.from_pretrained(folder)
        except Exception as exc:  # noqa: BLE001 - transformers' own validation of the values
            raise UserError(f"{str(folder / 'generation_config.json')!r} is refused by transformers ({reason(exc)}); "
                            "fix or remove it") from None


def weight_files(folder: Path) -> list[Path]:
    """The weight files a load of this folder reads (a sharded index names them)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(n, str) and n.strip() for n in weight_map.values()):
            raise UserError(f"{str(index)!r} is damaged (its weight_map does not map tensor names to weight files "
                            "of the folder); re-download or re-export the model")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise UserError(f"model folder {str(folder)!r} lacks {missing[0]} (named in {index.name}"
                            f"{f' with {len(missing) - 1} more' if len(missing) > 1 else ''}); "
                            "re-download or re-export the model")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin")):
        return []  # other layouts: the loader's own errors apply
    raise UserError(f"model folder {str(folder)!r} has no weights (model.safetensors or pytorch_model.bin); "
                    "add them, or set model.random_init=true to train it from fresh weights")


def check_safetensors(path: Path) -> None:
    """Reads only the header: a truncated or damaged file is refused before anything is built."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # SafetensorError, or OSError for an unreadable file
        raise UserError(f"weights file {str(path)!r} is truncated or damaged ({first_line(exc, 100)}); "
                        "re-download or re-export the model") from None


def save_model_code(hf_config, folder: Path) -> None:
    """A trust_remote_code model's own modules (its modeling file and what that imports) beside the
    config.json written into `folder`, as `save_pretrained` copies them: `config.save_pretrained`
    copies the config's module only, and a checkpoint or a sharded final/ whose config.json names
    a modeling file it lacks could be neither exported, evaluated nor loaded. A config of
    transformers' own class has no code of its own: nothing is copied."""
    from transformers.dynamic_module_utils import custom_object_save, get_class_from_dynamic_module
    from transformers.utils import TRANSFORMERS_DYNAMIC_MODULE_NAME

    ref = (getattr(hf_config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if not ref or not type(hf_config).__module__.startswith(TRANSFORMERS_DYNAMIC_MODULE_NAME + "."):
        return
    from transformers import AutoModelForCausalLM

    try:  # registered when this process built the model from its config
        model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:
        model_class = get_class_from_dynamic_module(ref, hf_config.name_or_path)
    custom_object_save(model_class, folder)
