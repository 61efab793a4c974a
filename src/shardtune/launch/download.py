"""`shardtune download`: fill the Hugging Face cache on a machine with network (a login node),
so compute nodes without it can train with HF_HUB_OFFLINE=1.

Models (and tokenizers) go to the hub cache ($HF_HOME/hub) as `from_pretrained` reads them
offline. Datasets are loaded once with `datasets.load_dataset`, which leaves them prepared in
the datasets cache ($HF_HOME/datasets): that, not the raw hub files, is what `load_dataset`
finds when it runs offline. `--cache-dir DIR` stands for $HF_HOME: set HF_HOME=DIR on the
compute nodes.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardtune.errors import UserError, first_line
from shardtune.fsio import json_loads, make_dir, refuse_inside_run
from shardtune.names import hub_id

# Weights in formats shardtune never reads: skipped so a 7B download is not three 7B downloads. And
# every subfolder: `from_pretrained(ID)` reads the repo's root only, and a repo shardtune published keeps
# each checkpoint in checkpoints/step-N/ (ten checkpoints were eleven models downloaded).
IGNORE = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.tflite", "*.mlmodel", "*.gguf", "*/*"]
PYTORCH_BINARIES = ["*.bin", "*.pt", "*.pth"]  # skipped where the repo's root has safetensors
WEIGHTS = ["*.safetensors", *PYTORCH_BINARIES]  # all a tokenizer-only target skips


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _is_local(path: str) -> bool:
    """A data.path / model name that data/pipeline.py or transformers would read from disk, not the hub."""
    from shardtune.data.layouts import builder_of

    return hub_id(path) is None or builder_of(path) is not None


def targets_from_recipe(recipe: str, overrides: list[str] | None = None) -> list[tuple[str, str, str | None]]:
    """(kind, repo id, dataset config name) for the model, tokenizer and dataset of a recipe, in
    that order, without duplicates; local folders and files are left out. A tokenizer from another
    repo than the model is kind "tokenizer", and a model trained from fresh weights
    (model.random_init) kind "config": neither repo's weights are downloaded (a 7B's 13 GB, never read)."""
    from shardtune.config.load import load_config

    cfg = load_config(recipe, overrides)
    found: list[tuple[str, str, str | None]] = []
    model = cfg.model.name_or_path if cfg.model.name_or_path and not _is_local(cfg.model.name_or_path) else None
    if model:
        found.append(("config" if cfg.model.random_init else "model", model, None))
    if cfg.model.tokenizer and cfg.model.tokenizer != model and not _is_local(cfg.model.tokenizer):
        found.append(("tokenizer", cfg.model.tokenizer, None))
    if cfg.data.path and not _is_local(cfg.data.path):
        found.append(("dataset", cfg.data.path, cfg.data.name))
    return found


def download(targets: list[tuple[str, str, str | None]], cache_dir: str | None = None) -> list[str]:
    """Download each target into the cache; returns where each one is."""
    # huggingface_hub reads TRANSFORMERS_OFFLINE as HF_HUB_OFFLINE: either fails every download
    if offline := next((name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if env_flag(name)), None):
        raise UserError(f"{offline}=1 is set, so nothing can be downloaded; run `shardtune download` "
                        "without it on a machine with network (e.g. a login node)")
    if env_flag("HF_DATASETS_OFFLINE") and any(kind == "dataset" for kind, _, _ in targets):
        raise UserError("HF_DATASETS_OFFLINE=1 is set, so no dataset can be downloaded; unset it on a "
                        "machine with network")
    root = Path(cache_dir).expanduser() if cache_dir else None
    if root is not None:
        refuse_inside_run(root, "--cache-dir")  # a run's --overwrite or saves would delete the downloads
        make_dir(root)  # a cache that cannot be written is told now, as itself, not as a network failure
    paths = []
    for kind, repo, config_name in targets:
        if kind in ("model", "tokenizer", "config"):
            paths.append(_download_model(repo, str(root / "hub") if root else None, weights=kind == "model"))
        elif kind == "dataset":
            paths.append(_download_dataset(repo, config_name, str(root / "datasets") if root else None))
        else:
            raise UserError(f"download target kind {kind!r} is unknown; use model:ID or dataset:ID")
    return paths


def _download_model(repo: str, cache_dir: str | None, weights: bool = True) -> str:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        files = HfApi().list_repo_files(repo)
        # only safetensors weights at the root replace the .bin ones (a safetensors file in a subfolder does not)
        ignore = IGNORE + (PYTORCH_BINARIES if any(f.endswith(".safetensors") and "/" not in f for f in files) else [])
        ignore += _unread_safetensors(repo, files, cache_dir) if weights else WEIGHTS  # a tokenizer's: no weights
        return snapshot_download(repo_id=repo, cache_dir=cache_dir, ignore_patterns=ignore)
    except RepositoryNotFoundError:  # also a gated repo without access
        raise UserError(f"model {repo!r} not found on the Hugging Face hub (or it is gated); check the name, "
                        "and for gated models accept the license on the hub and `hf auth login`") from None
    except Exception as exc:  # noqa: BLE001 - the Hub client's HTTP library (httpx, requests) raises its own kinds
        raise UserError(f"could not download model {repo!r} ({type(exc).__name__}: {first_line(exc)}); check "
                        f"{_check(exc, 'the network and the name')}") from None


def _unread_safetensors(repo: str, files: list[str], cache_dir: str | None) -> list[str]:
    """The repo's root safetensors files from_pretrained never reads, as ignore patterns: all but
    model.safetensors where that is there (transformers takes it first), else those its index does
    not name (Mistral's consolidated.safetensors beside its shards: the model twice over)."""
    import glob

    root = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    if "model.safetensors" in root:
        read = {"model.safetensors"}
    elif "model.safetensors.index.json" in files:
        from huggingface_hub import hf_hub_download

        index = json_loads(Path(hf_hub_download(repo, "model.safetensors.index.json", cache_dir=cache_dir)).read_text())
        read = set((index.get("weight_map") or {}).values()) if isinstance(index, dict) else set()
    else:
        return []
    return [glob.escape(f) for f in root if read and f not in read]


def _check(exc: BaseException, otherwise: str) -> str:
    """What to check after a failed download: the Hub answers 401 to a token it does not know, even
    for a public repo."""
    if getattr(getattr(exc, "response", None), "status_code", None) == 401:
        return "the token (HF_TOKEN or `hf auth login`: a valid one, or none for a public repo)"
    return otherwise


def _download_dataset(repo: str, config_name: str | None, cache_dir: str | None) -> str:
    import datasets

    datasets.disable_progress_bars()
    label = repo + (f" ({config_name})" if config_name else "")
    try:
        loaded = datasets.load_dataset(repo, config_name, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many kinds (not found, no config name, network)
        raise UserError(f"could not download dataset {label!r} ({type(exc).__name__}: {first_line(exc)}); "
                        "check " + _check(exc, "the name and the network (a dataset with several configs needs "
                                          "dataset:ID:CONFIG or data.name in the recipe)")) from None
    files = [f["filename"] for split in loaded.values() for f in split.cache_files]
    return str(Path(files[0]).parent) if files else (cache_dir or datasets.config.HF_DATASETS_CACHE)
