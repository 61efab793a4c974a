"""A trained model in this process alone, without a process group: from an HF folder or hub id,
a peft adapter folder, a run folder, or a sharded checkpoint (read shard by shard, no optimizer).
`eval`, `generate` and `export` load through here."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardtune.checkpoint.dcp import dcp_load
from shardtune.checkpoint.folders import final_step, read_meta, resolve_checkpoint, run_folder, run_trusts, run_weights
from shardtune.errors import UserError
from shardtune.names import hub_id


def model_step(spec: str) -> int | None:
    """The training step of the model `spec` names, where its run tells it: a checkpoint's own, a
    run's final/ (which records none) the last step its run logged; None for a model of no run."""
    kind, where = resolve_model(spec)
    if kind == "checkpoint":
        return read_meta(where)["step"]
    run = run_folder(spec)
    if run is None:
        return None
    if (step := final_step(run / "final")) is not None and Path(where).resolve() == (run / "final").resolve():
        return step
    from shardtune.telemetry.report import logged_step

    return logged_step(run)  # a final/ of an older shardtune, which records no step


def pinned(spec: str | None, say=None) -> str | None:
    """The folder of the weights a command reads for `spec`, chosen once: a run folder's final/ or
    checkpoint (checkpoint.folders.run_weights), told to `say` for the command's first line (export
    reads and says the same); anything else as given. Every later read takes that folder: a live run
    that saved a checkpoint meanwhile had the line and the weights of two steps."""
    path = Path(spec).expanduser() if spec else None
    picked = run_weights(path) if path is not None else None
    if picked is None:
        return spec
    if say is not None:
        say(picked.line(spec))
    return str(picked.path)


class Reading:
    """`pinned`'s `say` for a command of one or more ranks: held until the command's checks
    have passed (`say()`: a refusal stays one line), then said by rank 0, on `file`."""

    def __init__(self, file=None):
        self.file, self.lines = file, []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def say(self) -> None:
        from shardtune.distributed.process_group import is_main_process

        for line in self.lines if is_main_process() else ():
            print(f"reading {line}", file=self.file or sys.stdout, flush=True)
        self.lines.clear()


def resolve_model(spec: str) -> tuple[str, Path | str]:
    """("checkpoint", folder), ("adapter", folder) or ("hf", folder or hub id). A run folder means
    what checkpoint.folders.run_weights picks (its final/, unless a checkpoint of a later step
    exists); checkpoints/latest the checkpoint it names."""
    path = Path(spec).expanduser()
    if path.name == "latest" and path.is_file():  # the pointer file: the checkpoint it names
        return "checkpoint", resolve_checkpoint(path.parent)
    picked = run_weights(path)
    if picked is not None:  # a peft run's final/: its adapter (+ base)
        kind = "hf" if (picked.path / "config.json").is_file() else "adapter"
        return ("checkpoint" if not picked.final else kind), picked.path
    if (path / "adapter_config.json").is_file():
        return "adapter", path
    if (path / "meta.json").exists() or (path / ".metadata").exists() or (path / "checkpoints").is_dir() \
            or path.name == "checkpoints":
        return "checkpoint", resolve_checkpoint(path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"{spec!r} is neither a model folder (config.json) nor a shardtune checkpoint or run folder; "
                        "give a model folder, a run folder (output_dir) or one of its checkpoints, or a Hub id")
    if path.exists():
        return "hf", path
    if hub_id(spec) is None:
        raise UserError(f"{spec!r} not found: no such folder here, and not a Hub id (org/name); give a model "
                        "folder, a shardtune run or checkpoint folder, or a Hub id")
    return "hf", spec


def load_model(spec: str, device: str = "cpu", weights: bool = True):
    """(model or None, tokenizer, hf_config, run config or None) in this process. Without
    `weights` only the small parts are read. Anything of a run (its folder, final/, a checkpoint)
    brings the config of its run, so its data is found the same way wherever the model comes from."""
    model, tokenizer, hf_config, run_cfg = _load(spec, device, weights)
    if run_cfg is None and (run := run_folder(spec)) is not None:
        from shardtune.config.load import load_saved_config

        run_cfg = load_saved_config(run / "config.yaml")
    return model, tokenizer, hf_config, run_cfg


def _load(spec: str, device: str, weights: bool):
    kind, where = resolve_model(spec)
    if kind == "checkpoint":
        from shardtune.config.load import load_saved_config

        run_cfg = load_saved_config(where / "meta.json", read_meta(where)["config"])
        if weights:
            model, tokenizer, _ = load_plain_model(where, device)
            return _folded(model), tokenizer, model.config, run_cfg
        meta = read_meta(where)
        hf_config, tokenizer = checkpoint_config(where, meta)
        return None, tokenizer, _folded_config(hf_config, meta["config"].get("peft", {}), run_cfg), run_cfg

    if kind == "adapter":  # evaluate/generate with the adapter folded into its base where it can be
        from shardtune.checkpoint.adapter_folder import adapter_parts, fit_adapter, load_base

        parts = adapter_parts(where)  # the tokenizer checked against the base's vocabulary there
        tokenizer = parts.tokenizer
        if not weights:
            return None, tokenizer, _folded_config(parts.base_config, parts.config), None
        # fp32, as a run reads the base and as a checkpoint or a model folder loads: a bf16 base (a hub
        # model's, as transformers loads it by default) rounded the folded update away in part
        model = _folded(fit_adapter(load_base(parts, dtype=torch.float32), where, parts.base))
        return model.to(torch.device(device)).eval(), tokenizer, model.config, None

    from shardtune.config.schema import ModelConfig
    from shardtune.model.hf import check_vocab, load_hf_config, load_source_model, load_tokenizer

    mc = ModelConfig(name_or_path=str(where), trust_remote_code=run_trusts(where))
    tokenizer, hf_config = load_tokenizer(mc), load_hf_config(mc)
    check_vocab(hf_config, tokenizer, "a token past those has no embedding: use the model's own tokenizer, or "
                "resize the model's embeddings and save it again", f"the tokenizer of model {spec!r}")
    if not weights:
        return None, tokenizer, hf_config, None
    model = load_source_model(mc, hf_config, seed=0).to(torch.device(device))
    return model.eval(), tokenizer, hf_config, None


def _folded(model):
    """A loaded peft model with a mergeable adapter (LoRA, DoRA, IA3) folded into its base: a
    plain model. Others (learned tokens, gates) stay the PeftModel (`adapter_structure`)."""
    from shardtune.model.adapters import MERGEABLE_PEFT_TYPES
    from shardtune.model.fold import fold

    if getattr(model, "peft_type", None) in MERGEABLE_PEFT_TYPES:
        return fold(model)
    return model


def _folded_config(hf_config, peft: dict, run_cfg=None):
    """The config of the model `_folded` gives, read without weights (`peft`: a checkpoint's peft
    section or an adapter_config.json), so that every rank of eval builds rank 0's model."""
    from shardtune.model.adapters import MERGEABLE_PEFT_TYPES
    from shardtune.model.fold import folded_config

    kind = str(peft.get("peft_type", peft.get("method", "none"))).upper()
    if kind not in MERGEABLE_PEFT_TYPES + ("DORA",):
        return hf_config
    trust = bool(run_cfg and run_cfg.model.trust_remote_code)
    return folded_config(hf_config, peft.get("target_modules"), trust)


def adapter_structure(spec: str):
    """The peft structure of the model `load_model(spec)` returns (a PeftConfig; method none for a
    plain or folded model), so that every rank builds the same skeleton for it: cheap, no weights."""
    from shardtune.config.schema import PeftConfig, known_fields
    from shardtune.model.adapters import peft_config_of

    kind, where = resolve_model(spec)
    if kind == "checkpoint":
        peft = known_fields(PeftConfig, read_meta(where)["config"].get("peft", {}))
    elif kind == "adapter":
        from shardtune.model.files import read_json_object

        peft = peft_config_of(read_json_object(where / "adapter_config.json"))
    else:
        return PeftConfig()
    return PeftConfig() if peft.mergeable else peft


def checkpoint_config(path: Path, meta: dict):
    """(HF config, tokenizer) saved beside a checkpoint's shards, with the checks of a model
    folder (config.json readable and buildable, tokenizer whole): one line each."""
    from shardtune.config.schema import ModelConfig
    from shardtune.model.hf import check_vocab, load_hf_config, load_tokenizer

    trust = bool(meta["config"].get("model", {}).get("trust_remote_code"))
    if not (path / "tokenizer").is_dir():
        raise UserError(f"checkpoint {str(path)!r} has no tokenizer/ folder (damaged, or copied in part); use "
                        "another checkpoint of the run, or copy the run's tokenizer folder into it")
    hf_config = load_hf_config(ModelConfig(name_or_path=str(path), random_init=True, trust_remote_code=trust))
    tokenizer = load_tokenizer(ModelConfig(tokenizer=str(path / "tokenizer"), trust_remote_code=trust))
    # train matched them; a tokenizer/ replaced since failed inside torch (eval, generate) or exported as it was
    check_vocab(hf_config, tokenizer, "a token past those has no embedding: copy back the tokenizer the run "
                "trained with, or use another checkpoint of the run", f"the tokenizer/ of checkpoint {str(path)!r}",
                "its model")
    return hf_config, tokenizer


def load_plain_model(path: Path, device: str = "cpu"):
    """(model, tokenizer, meta) from a checkpoint, in this process alone: one copy of the
    weights in memory, read shard by shard from the DCP files; the optimizer is never read."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    meta = read_meta(path)
    trust = bool(meta["config"].get("model", {}).get("trust_remote_code"))
    hf_config, tokenizer = checkpoint_config(path, meta)
    with no_init_weights(), torch.device(device):  # real buffers (e.g. rotary), parameters left empty
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=trust)
    peft_cfg = meta["config"].get("peft", {})
    if peft_cfg.get("method", "none") != "none":  # the checkpoint holds the adapter-wrapped names
        from shardtune.config.schema import PeftConfig, known_fields
        from shardtune.model.adapters import add_adapter

        # the structure only: every value (PiSSA/OLoRA's residual base too) comes from the checkpoint
        model = add_adapter(model, known_fields(PeftConfig, peft_cfg), init=False)
    # tied before the read: no_init_weights leaves the head its own tensor, and a checkpoint.hf_format
    # checkpoint holds a tied head once (read_model_part accepts a key it lacks only as a tied copy)
    model.tie_weights()
    dcp_load({"model": model.state_dict()}, path, no_dist=True)
    from shardtune.model.hf import load_generation_config

    # the run's, saved beside the shards (none in an older checkpoint: derived, as from_config does)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft generates with its base's
    inner.generation_config = load_generation_config(path, hf_config)
    model.eval()
    return model, tokenizer, meta
