"""A peft adapter folder (the final/ of a peft run) read whole before peft touches it: its
config, the base it names (or the copy in ADAPTER/base where that is gone), its weights, and
the adapter fitted onto the base, each refused in one line. `generate`, `eval` and
`export --merge` open adapters through here."""

from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError

REEXPORT = "use the final/ folder of the run as it was written, or train again"


def adapter_parts(adapter: Path) -> tuple[dict, str]:
    """(adapter_config.json, the base model to load it on), with the weights file checked."""
    from peft import PeftType

    from shardtune.model.files import check_safetensors, read_json_object

    config = read_json_object(adapter / "adapter_config.json")
    kind = config.get("peft_type")
    if kind not in {t.value for t in PeftType}:
        raise UserError(f"{str(adapter / 'adapter_config.json')!r} names peft_type={kind!r}, which peft does not "
                        f"know; {REEXPORT}")
    base = config.get("base_model_name_or_path")
    base = base if isinstance(base, str) and base.strip() else None
    beside = adapter / "base"  # the run's copy, where the named base is gone (the run moved)
    if (base is None or not Path(base).is_dir()) and (beside / "config.json").is_file():
        base = str(beside)
    if base is None:
        raise UserError(f"{str(adapter / 'adapter_config.json')!r} names no base model "
                        "(base_model_name_or_path); set it to the hub id or folder the adapter was trained on")
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file() and not (adapter / "adapter_model.bin").is_file():
        raise UserError(f"adapter folder {str(adapter)!r} has no adapter_model.safetensors; {REEXPORT}")
    if weights.is_file():
        check_safetensors(weights)
    return config, base


def load_base(base: str, **kwargs):
    """The base model an adapter goes on, or one line saying it is not there."""
    from transformers import AutoModelForCausalLM

    from shardtune.model.files import hub_hint

    try:
        return AutoModelForCausalLM.from_pretrained(base, **kwargs)
    except OSError:
        raise UserError(f"base model {base!r} of the adapter not found; {hub_hint(base)}") from None


def fit_adapter(model, adapter: Path, base: str):
    """peft's PeftModel of `model` with the adapter's weights; a mismatch (another base, an
    edited config) is one line."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(adapter))
    except Exception as exc:  # noqa: BLE001 - peft's and torch's errors for an adapter that does not fit
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        why = " ".join(lines[:2])[:200] or type(exc).__name__
        raise UserError(f"adapter folder {str(adapter)!r} does not fit its base {base!r} ({type(exc).__name__}: "
                        f"{why}); {REEXPORT}") from None
