"""The one check of a resolved run, called by every command before it builds anything: `train`
(and each of its ranks), `plan`, `sweep` (every grid point, the search space's values, before
trial 1) and `eval`. What needs only the config was validated when it loaded
(`config.validation`); here: the model's HF config, the tokenizer, the ranks, the machine, the
Hub. The data's contents are checked where they are read (`data.pipeline`, `data.formats`),
and name the config key that caused a refusal."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardtune.config.load import check_world
from shardtune.config.schema import RunConfig
from shardtune.config.validation import unread_data_keys
from shardtune.errors import UserError


@dataclasses.dataclass(frozen=True)
class CheckedRun:
    """A resolved run that passed the check, with what the check loaded: the build starts here."""
    cfg: RunConfig
    hf_config: Any
    tokenizer: Any
    accum: int  # gradient-accumulation steps on `world_size` ranks
    world_size: int
    publishes: bool  # uploads to the Hub (a token is at hand)


def check_model(cfg: RunConfig, hf_config, tokenizer=None) -> None:
    """What the model's config and its tokenizer (where at hand) must allow: the vocabulary, the
    positions, the peft method (its targets, on the model's meta skeleton), freezing, document
    masking. The same lines for every command."""
    from shardtune.data import docmask
    from shardtune.model.adapters import check_method
    from shardtune.model.build import ModelSpec, check_structure
    from shardtune.model.hf import check_seq_len, check_vocab, match_tokenizer

    if tokenizer is not None:
        match_tokenizer(hf_config, tokenizer, cfg.model)
        check_vocab(hf_config, tokenizer, "use the model's own tokenizer or set model.config.vocab_size")
    check_seq_len(hf_config, cfg.data.seq_len, cfg.peft.virtual_tokens)
    check_method(cfg.peft, hf_config)
    sizes = (cfg.train.micro_batch_size, cfg.eval.micro_batch_size or cfg.train.micro_batch_size)
    docmask.check(cfg.data, hf_config, max(sizes) if all(isinstance(n, int) for n in sizes) else None)
    spec = ModelSpec.of_run(cfg, hf_config)
    check_structure(spec)
    if cfg.checkpoint.hf_format:  # transformers' renames on save, read from the keys of the meta skeleton
        from shardtune.checkpoint.hf_sharded import check_hf_keys
        from shardtune.model.build import skeleton

        check_hf_keys(skeleton(spec)[0].state_dict(), hf_config)


def local_tokenizer(model_cfg):
    """The run's tokenizer where it is a local folder, else None: `plan` and `sweep`'s checks
    read no network (a hub tokenizer is checked by the run that downloads it)."""
    from pathlib import Path

    from shardtune.model.files import check_model_source
    from shardtune.model.hf import load_tokenizer

    source = model_cfg.tokenizer or model_cfg.name_or_path
    if source is not None:  # a folder that is not there is refused here as by train, a Hub id is not read
        check_model_source(source, "model.tokenizer" if model_cfg.tokenizer else "model.name_or_path")
    return load_tokenizer(model_cfg) if source is not None and Path(source).is_dir() else None


def check_config(cfg: RunConfig, hf_config=None) -> None:
    """check_model for a command that builds nothing yet (plan, sweep): the model's config as
    given (else loaded), the tokenizer where it is a local folder."""
    from shardtune.model.hf import load_hf_config

    check_model(cfg, load_hf_config(cfg.model) if hf_config is None else hf_config, local_tokenizer(cfg.model))


def check_config_here(cfg: RunConfig) -> None:
    """check_config for a job written here to run elsewhere (`slurm`), where this machine holds the
    model's config without the network: a folder, model.config, or the Hub cache. A model not
    downloaded here yet is left to the job's own check."""
    from pathlib import Path

    from shardtune.model.hf import load_hf_config
    from shardtune.names import hub_id

    name = cfg.model.name_or_path
    if name is not None and not Path(name).expanduser().exists() and hub_id(name) is not None:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    check_config(cfg, load_hf_config(cfg.model, local_files_only=True))


def job_world_size() -> int:
    """The ranks of this job: the process group's, else what torchrun/srun set, else 1."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    from shardtune.distributed.process_group import agent_world

    return agent_world()[0]


def check_run(cfg: RunConfig, world_size: int | None = None, device=None, say=None) -> CheckedRun:
    """`train`'s check of a resolved run (micro-batch a number, checkpointing a mode, output_dir set) on `world_size`
    ranks of `device` (a torch device; default: the one the run asks for on this machine)."""
    from pathlib import Path

    from shardtune.distributed.process_group import is_main_process, resolve_device
    from shardtune.model.build import check_machine
    from shardtune.model.hf import load_hf_config, load_tokenizer
    from shardtune.publish.hub import check_ready
    from shardtune.telemetry.trackers import check_trackers

    if "auto" in (cfg.train.micro_batch_size, cfg.activation_checkpointing) or cfg.output_dir is None:
        raise ValueError("check_run takes a resolved run (resolve.run.resolve_run): micro_batch_size a number, "
                         "activation_checkpointing a mode, output_dir set")
    world_size = job_world_size() if world_size is None else world_size
    device = resolve_device(cfg.device) if device is None else device
    check_machine(cfg, device)
    accum = check_world(cfg, world_size)
    check_node_layout(cfg)
    main = is_main_process()
    say = say or (lambda text: print(text, flush=True) if main else None)
    publishes = check_ready(cfg.publish, say)
    for line in unread_data_keys(cfg.data):
        say(line)
    if main:  # only rank 0 logs to the trackers
        check_trackers(cfg.log.trackers, out=Path(cfg.output_dir))
    tokenizer = load_tokenizer(cfg.model)
    hf_config = load_hf_config(cfg.model)
    check_model(cfg, hf_config, tokenizer)
    if cfg.kernels != "none":  # the family Liger has kernels for (its list needs Liger, so only here)
        from shardtune.model.kernels import check

        check(cfg.kernels, device, getattr(hf_config, "model_type", None))
    return CheckedRun(cfg, hf_config, tokenizer, accum, world_size, publishes)


def check_node_layout(cfg: RunConfig) -> None:
    """hybrid_shard's default shard group is a node's ranks; srun alone may put different numbers of
    tasks on the step's nodes (SLURM_STEP_TASKS_PER_NODE="2(x2),1"), and each rank built the mesh of its
    own node's count: some refused, some waited, or (2, 2, 1, 1 tasks) ranks built (3, 2) and (6, 1)
    meshes side by side. Refused on every rank alike (each reads the step's whole layout)."""
    from shardtune.distributed.process_group import slurm_tasks_per_node

    fsdp = cfg.fsdp
    told = slurm_tasks_per_node() if fsdp.sharding == "hybrid_shard" else None
    if told and len(set(told[1])) > 1 and not (fsdp.shard_size or fsdp.replicate_size):
        import os

        raise UserError(f"fsdp.sharding=hybrid_shard makes a shard group of each node's ranks, but this srun step's "
                        f"nodes have different numbers of tasks ({told[0]}={os.environ[told[0]].strip()}); give every "
                        "node the same number (srun --ntasks-per-node) or set fsdp.shard_size")


def check_export(spec: str, out, merge: bool = False) -> None:
    """`export`'s check, before any weight is read: the checkpoint or a run's final/ (complete; the
    run config it saved still loads, with train's lines where it does not), or with `merge` the
    adapter folder (`checkpoint.export.merge_source`), and an output folder of its own (new, or empty)."""
    from pathlib import Path

    from shardtune.checkpoint.folders import export_source, read_meta
    from shardtune.config.load import load_saved_config

    if merge:
        from shardtune.checkpoint.export import merge_source

        check_export_folder(merge_source(Path(spec))[0], "adapter folder", out)
        return
    source = export_source(spec)  # a run folder: what eval and generate read too (checkpoint.folders.run_weights)
    check_export_folder(source.path, "final model" if source.final else "checkpoint", out)
    if not source.final:
        load_saved_config(source.path / "meta.json", read_meta(source.path)["config"])
        return
    load_saved_config(source.path.parent / "config.yaml")  # export_base reads it for --push-to-hub
    if (source.path / "adapter_config.json").is_file() and not (source.path / "config.json").is_file():
        from shardtune.checkpoint.adapter_folder import adapter_parts

        adapter_parts(source.path)  # its base and tokenizer there: a copy that loads


def check_export_folder(source, what: str, out) -> None:
    """An export's output folder: not a file, not inside what it exports (`source`, a `what`) or
    inside a run's folders that the run replaces, and new or empty."""
    from shardtune.fsio import refuse_inside_run, refuse_non_folder, whole_folder

    refuse_non_folder(out, "export folder")
    whole_folder(out, "export folder")  # written whole and renamed into place: never the working directory
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise UserError(f"export folder {str(out)!r} lies inside {what} {str(source)!r} (removing that {what} "
                        "would remove the export); choose a folder outside it")
    refuse_inside_run(out, "export folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"export folder {str(out)!r} is not empty; choose a new folder")


def check_push(repo: str) -> None:
    """`export --push-to-hub`'s check, before the export: the network allowed and a token at hand
    (else the whole export ran first and only the upload failed)."""
    from huggingface_hub import constants

    from shardtune.publish.hub import TOKEN_FIX, hub_token

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--push-to-hub {repo} needs the network, but HF_HUB_OFFLINE is set; unset it, or export "
                        "without --push-to-hub and upload the folder later")
    if not hub_token():
        raise UserError(f"--push-to-hub {repo} needs a Hub token with write access; {TOKEN_FIX}")
