"""What a model, tokenizer or dataset name refers to: a path on this machine, or a Hugging Face
Hub id. One rule for every reader of a name (the model and tokenizer loaders, `plan`, `download`,
the model card), so a name is never a folder to one command and a Hub id to another."""

from __future__ import annotations

from pathlib import Path


def hub_id(name: str | None) -> str | None:
    """`name` where it can only be a Hub id: not a path that exists here (`~` expanded), and spelled
    as the Hub allows (`org/name` or `name`; no leading `/`, `.` or `~`, one slash at most, no
    spaces); else None."""
    if not name or Path(name).expanduser().exists():
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name
