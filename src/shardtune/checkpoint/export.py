"""Plain Hugging Face folders out of a sharded model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardtune.errors import UserError
from shardtune.fsio import atomic_dir, whole_folder

if TYPE_CHECKING:
    from shardtune.checkpoint.adapter_folder import AdapterParts


def gather_full_state_dict(model) -> dict:
    """Full (unsharded) weights on rank 0's CPU; other ranks get {} and never hold a full copy."""

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf_folder(state_dict: dict, hf_config, tokenizer, out: Path, max_shard_size: int | str = "2GB",
                   generation=None) -> None:
    """Write config, safetensors weights (sharded above max_shard_size), generation config (`generation`,
    else derived from hf_config) and tokenizer, loadable by `AutoModelForCausalLM.from_pretrained(out)`
    unchanged."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    shell.load_state_dict(state_dict, assign=True, strict=False)
    shell.tie_weights()
    missing = [n for n, p in shell.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"export is missing weights: {missing[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    if generation is not None or shell.generation_config is None:
        shell.generation_config = generation or GenerationConfig.from_model_config(hf_config)
    shell.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def export_checkpoint(spec: str, out: Path, max_shard_size: int | str = "2GB") -> Path:
    """`shardtune export`: a sharded checkpoint, or what a run folder stands for (its final/ unless a
    later checkpoint exists: checkpoint.folders.run_weights, as eval and generate read it) -> plain HF
    folder. One process, one copy of the weights; no process group and no optimizer state."""
    from shardtune.checkpoint.folders import export_source, is_run_folder

    source = export_source(spec)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"export folder {str(out)!r} is not empty; choose a new folder")
    if is_run_folder(Path(spec).expanduser()):  # which of its weights, as eval and generate say it (RunWeights.line)
        print(f"exporting {source.line(spec)}", flush=True)
    if source.final:
        export_final(source.path, out, max_shard_size)
    else:
        write_export(source.path, out, max_shard_size)
    step = f"step {source.step}" if source.step is not None else "step not recorded"
    print(f"exported {source.path} ({step}) to {out}", flush=True)
    return out


def export_final(final: Path, out: Path, max_shard_size: int | str = "2GB") -> None:
    """A run's final/ into `out`, as the export of a checkpoint of its step writes it: a full model's
    weights read by key from final/'s safetensors and laid out at `max_shard_size`, one output file at
    a time; a peft run's adapter folder copied, its config naming out/base where it named final/base
    (that base/ copy keeps final/'s files)."""
    import shutil
    import warnings

    from shardtune.checkpoint.folders import FINAL_RECORD

    if (final / "adapter_config.json").is_file() and not (final / "config.json").is_file():
        from shardtune.fsio import json_loads

        with atomic_dir(out) as tmp:
            shutil.copytree(final, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(FINAL_RECORD))
            config = json_loads((tmp / "adapter_config.json").read_text())
            if config.get("base_model_name_or_path") == str((final / "base").resolve()):
                config["base_model_name_or_path"] = str((whole_folder(out) / "base").resolve())
                (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return
    from shardtune.checkpoint.folders import run_trusts
    from shardtune.checkpoint.loading import load_model
    from shardtune.config.schema import ModelConfig
    from shardtune.model.hf import load_generation_config, load_hf_config, load_tokenizer
    from shardtune.model.hf_sharded_io import read_safetensors_into

    def read(part: dict) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            missing = read_safetensors_into(part, final, no_dist=True)
        if missing:
            raise UserError(f"{str(final)!r} lacks weights {sorted(missing)[:3]} (damaged?); export a checkpoint "
                            "of the run instead (RUN/checkpoints/step-N)")

    model_cfg = ModelConfig(name_or_path=str(final), trust_remote_code=run_trusts(final))
    hf_config, tokenizer = load_hf_config(model_cfg), load_tokenizer(model_cfg)
    generation = load_generation_config(final, hf_config)
    with atomic_dir(out) as tmp:
        done = export_streamed(final, hf_config, tokenizer, tmp, max_shard_size, generation, read)
    if not done:  # keys renamed on save: loaded whole, as transformers reads them back
        model, tokenizer, _, _ = load_model(str(final))
        with atomic_dir(out, replace=True) as tmp:
            save_hf_folder(model.state_dict(), model.config, tokenizer, tmp, max_shard_size, model.generation_config)


def write_export(path: Path, out: Path, max_shard_size: int | str = "2GB", replace: bool = False) -> dict:
    """The export of the checkpoint folder `path` into `out` (a peft run's: its adapter), quietly;
    returns the checkpoint's meta.json. Also what a run's Hub publisher uploads."""
    from transformers.utils import logging as hf_logging

    from shardtune.checkpoint.folders import read_meta
    from shardtune.checkpoint.loading import checkpoint_config, load_plain_model
    from shardtune.model.hf import load_generation_config

    hf_logging.set_verbosity_error()
    meta = read_meta(path)
    model_cfg = meta["config"].get("model", {})
    if meta["config"].get("peft", {}).get("method", "none") == "none" and not model_cfg.get("trust_remote_code"):
        # a full model: one output file in memory at a time
        hf_config, tokenizer = checkpoint_config(path, meta)
        with atomic_dir(out, replace=replace) as tmp:
            done = export_streamed(path, hf_config, tokenizer, tmp, max_shard_size,
                                   load_generation_config(path, hf_config))
        if done:
            return meta
    model, tokenizer, meta = load_plain_model(path)
    with atomic_dir(out, replace=replace) as tmp:  # a disk that fills half-way leaves no folder that loads
        if getattr(model, "peft_config", None):  # a peft run's checkpoint: the adapter, as in final/
            from shardtune.config.schema import ModelConfig, PeftConfig, known_fields

            save_adapter_folder(model.state_dict(), model, known_fields(ModelConfig, meta["config"].get("model", {})),
                                known_fields(PeftConfig, meta["config"].get("peft", {})), model.config, tokenizer, tmp,
                                final=out, max_shard_size=max_shard_size, generation=model.generation_config)
        else:
            save_hf_folder(model.state_dict(), model.config, tokenizer, tmp, max_shard_size, model.generation_config)
    return meta


def export_streamed(path: Path, hf_config, tokenizer, out: Path, max_shard_size: int | str = "2GB",
                    generation=None, read=None) -> bool:
    """A full-model checkpoint -> the folder save_pretrained writes, holding one output file's
    tensors at a time (read from the DCP files by key, written tensor by tensor), never the whole
    model. False (nothing written) where the model's keys are renamed on save; the caller loads
    it whole then. `read(part)` fills a file's tensors (default: from the DCP checkpoint `path`)."""
    from shardtune.checkpoint.dcp import dcp_load
    from shardtune.model.hf_sharded_io import hf_file_plan, write_index_and_configs, write_safetensors

    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        shapes = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).state_dict()
    plan = hf_file_plan(hf_config, shapes, max_shard_size)
    if plan is None:
        return False
    shell, file_of = plan
    for name in sorted(set(file_of.values())):
        part = {k: torch.empty(shapes[k].shape, dtype=shapes[k].dtype) for k, f in file_of.items() if f == name}
        if read is not None:
            read(part)
        else:
            dcp_load({"model": part}, path, no_dist=True)
        write_safetensors(out / name, part)  # a full disk: an OSError naming the file
        del part
    write_index_and_configs(out, shell, file_of, hf_config, tokenizer, generation)
    return True


def save_adapter_folder(state_dict: dict, peft_model, model_cfg, peft_cfg, hf_config, tokenizer, out: Path,
                        final: Path | None = None, max_shard_size: int | str = "2GB", generation=None) -> None:
    """A peft run (any method): the adapter in peft's format (`PeftModel.from_pretrained` loads
    it). A base that is not a hub model as it is (a local folder, a random init, a hub model with
    model.config overrides), or whose weights the method changed (PiSSA/OLoRA keep the residual),
    is saved beside it, in out/base (sharded above `max_shard_size`, as a full model's export is),
    and the adapter config points there, so the pair loads on any machine that has the folder. The
    run's generation config goes beside the adapter too: a hub base's own stops at none of the ends
    the run trained (checkpoint.adapter_folder.fit_adapter puts it on the base)."""
    import copy

    from safetensors.torch import save_file

    from shardtune.model.adapters import base_weights
    from shardtune.model.prompt_learning import adapter_state_dict

    out.mkdir(parents=True, exist_ok=True)
    adapter = adapter_state_dict(peft_model, state_dict)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = copy.deepcopy(peft_model.peft_config["default"])
    if hasattr(config, "init_lora_weights"):
        config.init_lora_weights = True  # loading must not initialise again (PiSSA/OLoRA would change the base)
    # the hub id names the base trained only without model.config overrides (rope scaling, norm eps,
    # ...: the adapter on the hub's own config gave other logits); QLoRA's 4-bit base is never copied
    overridden = model_cfg.config and peft_cfg.quantize == "none"
    pretrained = model_cfg.name_or_path and not model_cfg.random_init and not peft_cfg.residual_init and not overridden
    if pretrained and (not Path(model_cfg.name_or_path).exists() or peft_cfg.quantize != "none"):
        # a hub id, or (QLoRA) the local folder the 4-bit base was quantized from
        local = Path(model_cfg.name_or_path)
        config.base_model_name_or_path = str(local.resolve()) if local.exists() else model_cfg.name_or_path
    else:
        save_hf_folder(base_weights(peft_model, state_dict), hf_config, tokenizer, out / "base", max_shard_size,
                       generation)
        config.base_model_name_or_path = str(((final or out) / "base").resolve())
    config.save_pretrained(str(out))
    if generation is not None:  # where the run's replies end (a hub base's own config has not that)
        generation.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def merge_source(adapter: Path) -> tuple[Path, AdapterParts]:
    """(adapter folder, its AdapterParts) that `export ADAPTER OUT --merge` reads: a run folder means its final/;
    a folder without adapter_config.json, or an adapter that cannot merge, is refused (no weights loaded)."""
    from transformers.utils import logging as hf_logging

    from shardtune.checkpoint.adapter_folder import adapter_parts
    from shardtune.model.adapters import MERGEABLE_PEFT_TYPES, peft_config_of

    hf_logging.set_verbosity_error()  # from the check on (adapter_parts reads the base's config): one line or none
    hf_logging.disable_progress_bar()
    from shardtune.checkpoint.folders import read_meta, run_weights

    picked = run_weights(adapter)
    if picked is not None and picked.final:
        adapter = picked.path  # a run folder: its final adapter
    elif picked is not None and read_meta(picked.path)["config"].get("peft", {}).get("method", "none") != "none":
        # eval and generate read that checkpoint: merging the older final/ (or none) misled
        raise UserError(f"{picked.line(adapter)}; --merge takes an adapter folder: export that checkpoint "
                        f"first (`shardtune export {picked.path} ADAPTER`), then merge ADAPTER")
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"{str(adapter)!r} is not a peft adapter folder (no adapter_config.json); "
                        "--merge takes the final/ folder of a peft.method=lora/dora/ia3 run")
    parts = adapter_parts(adapter)
    peft_config_of(parts.config)  # a type shardtune loads: "use the adapter folder as it is" must hold
    kind = str(parts.config.get("peft_type", "?"))
    if kind not in MERGEABLE_PEFT_TYPES:
        raise UserError(f"an adapter of peft_type {kind} cannot be merged into its base (its learned tokens/gates "
                        "are no weights of the base); only lora, dora and ia3 merge: use the adapter folder as it is")
    return adapter, parts


def merge_adapter_folder(adapter: Path, out: Path, max_shard_size: int | str = "2GB") -> Path:
    """`shardtune export ADAPTER OUT --merge`: base + adapter (LoRA, DoRA, IA3) folded into plain
    weights, in the base's own dtype. The base is the one the adapter config names; if that folder is gone (the
    run folder was moved or copied to another machine), the copy in ADAPTER/base is used. A method
    that cannot merge is refused before anything is loaded."""
    from shardtune.checkpoint.adapter_folder import fit_adapter, load_base
    from shardtune.model.fold import fold

    adapter, parts = merge_source(adapter)
    base = parts.base
    if out.exists() and any(out.iterdir()):
        raise UserError(f"export folder {str(out)!r} is not empty; choose a new folder")
    model = fold(fit_adapter(load_base(parts, dtype="auto"), adapter, base))
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
        parts.tokenizer.save_pretrained(tmp)  # the adapter's own, else its base's (adapter_folder.tokenizer_source)
    print(f"merged the adapter {adapter} into {base}; wrote {out}", flush=True)
    return out
