"""A peft adapter folder (the final/ of a peft run) read whole before peft touches it: its
config, the base it names (or the copy in ADAPTER/base where that is gone), its weights, its
tokenizer against the base's vocabulary, and the adapter fitted onto the base, each refused in
one line. `generate`, `eval` and `export --merge` open adapters through here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from shardtune.errors import UserError

REEXPORT = "use the final/ folder of the run as it was written, or train again"


class AdapterParts(NamedTuple):
    config: dict  # adapter_config.json
    base: str  # the base model to load it on
    base_config: Any  # the base's HF config
    tokenizer: Any  # the adapter folder's own tokenizer, else its base's (`tokenizer_source`)
    trust: bool = False  # the base runs its own code: the final/ of a run with model.trust_remote_code


def adapter_parts(adapter: Path) -> AdapterParts:
    """The adapter folder's parts, with the weights file checked and the tokenizer refused where
    it has ids past the base's embedding: peft loads such a pair without a word, and the first
    such token failed inside torch (an IndexError), or `export --merge` wrote a folder every
    command refuses."""
    from shardtune.model.adapters import require_peft

    require_peft(f"the adapter folder {str(adapter)!r}")
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
    from shardtune.checkpoint.folders import run_trusts
    from shardtune.config.schema import ModelConfig
    from shardtune.model.hf import check_vocab, load_tokenizer

    trust = run_trusts(adapter)
    hf_config = base_config(base, trust)
    source = tokenizer_source(adapter, base)
    tokenizer = load_tokenizer(ModelConfig(tokenizer=source, trust_remote_code=trust))  # its own one-line refusals
    check_vocab(hf_config, tokenizer, "a token past those has no embedding: use the base's own tokenizer, or "
                "set base_model_name_or_path in adapter_config.json to a base resized to this tokenizer",
                f"the tokenizer in {source!r}", f"the adapter's base model {base!r}")
    return AdapterParts(config, base, hf_config, tokenizer, trust)


def tokenizer_source(adapter: Path, base: str) -> str:
    """Where the adapter's tokenizer is: its folder's own (a run saves one there; a broken one is
    refused as such), else its base's: a peft adapter saved elsewhere usually has none."""
    from shardtune.model.files import TOKENIZER_FILES

    return str(adapter) if any((adapter / name).is_file() for name in TOKENIZER_FILES) else base


def base_missing(base: str) -> UserError:
    from shardtune.model.files import hub_hint

    return UserError(f"base model {base!r} of the adapter not found; {hub_hint(base)}")


def base_config(base: str, trust: bool = False):
    """The HF config of the base an adapter goes on, or one line saying it is not there (or that
    it runs code of its own, which only a run that trusted it has said may run)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(base, trust_remote_code=trust)
    except OSError:
        raise base_missing(base) from None
    except ValueError as exc:  # transformers' "contains custom code which must be executed"
        if "trust_remote_code" not in str(exc):
            raise
        raise UserError(f"the adapter's base model {base!r} runs code of its own (trust_remote_code); shardtune "
                        "runs it only for the final/ of a run trained with model.trust_remote_code=true") from None


def load_base(parts: AdapterParts, **kwargs):
    """The base model an adapter goes on, or one line saying it is not there."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(parts.base, trust_remote_code=parts.trust, **kwargs)
    except OSError:
        raise base_missing(parts.base) from None


def fit_adapter(model, adapter: Path, base: str):
    """peft's PeftModel of `model` with the adapter's weights; a mismatch (another base, an
    edited config) is one line."""
    from peft import PeftModel
    from transformers import GenerationConfig

    if (adapter / "generation_config.json").is_file():  # the run's (save_adapter_folder): peft reads none
        model.generation_config = GenerationConfig.from_pretrained(adapter)
    try:
        return PeftModel.from_pretrained(model, str(adapter))
    except Exception as exc:  # noqa: BLE001 - peft's and torch's errors for an adapter that does not fit
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        why = " ".join(lines[:2])[:200] or type(exc).__name__
        raise UserError(f"adapter folder {str(adapter)!r} does not fit its base {base!r} ({type(exc).__name__}: "
                        f"{why}); {REEXPORT}") from None
