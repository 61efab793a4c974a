"""`shardtune download`: fill the Hugging Face cache on a machine with network (a login node),
so compute nodes without it can train with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UserError


def targets_from_recipe(recipe: str) -> list[tuple[str, str, str | None]]:
    """(kind, repo id, dataset config name) for the model, tokenizer and dataset of a recipe."""
    from .config import load_config

    cfg = load_config(recipe)
    found = []
    for name in {cfg.model.name_or_path, cfg.model.tokenizer} - {None}:
        if not Path(name).exists():
            found.append(("model", name, None))
    if cfg.data.path and not Path(cfg.data.path).exists():
        found.append(("dataset", cfg.data.path, cfg.data.name))
    return found


def download(targets: list[tuple[str, str, str | None]], cache_dir: str | None = None) -> list[str]:
    """Download each target into the cache; returns the local paths."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError("HF_HUB_OFFLINE=1 is set, so nothing can be downloaded; unset it on a machine with network")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    paths = []
    for kind, repo, _config_name in targets:
        try:
            paths.append(snapshot_download(repo_id=repo, repo_type=kind, cache_dir=cache_dir))
        except RepositoryNotFoundError:
            raise UserError(f"{kind} {repo!r} not found on the Hugging Face hub; check the name "
                            "(and log in with `hf auth login` for gated repositories)") from None
        except (HfHubHTTPError, OSError) as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise UserError(f"could not download {kind} {repo!r} ({first}); check the network "
                            "and the name") from None
    return paths
