"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of OUTPUT_DIR/checkpoints/:

    step-000120/             one complete checkpoint, named by optimizer step
      .metadata, *.distcp    DCP: model + optimizer; every rank writes only its own shards
      model*.safetensors     with checkpoint.hf_format: the model instead, in HF's layout (+ index),
                             so from_pretrained loads the folder; DCP then holds the optimizer
      rng-rank00000.pt       that rank's RNG states (python, numpy, torch, cuda)
      config.json tokenizer/ the HF model config and tokenizer: export/eval/generate need nothing else
      meta.json              step, world size, the state objects (train_state, scaler), data position, run config
    latest                   name of the newest complete checkpoint (replaced atomically)
    .tmp-step-000130/        a save in progress, or one killed mid-way (removed on restart; one killed
                             after its meta.json, whole, is renamed into place instead)

A checkpoint is written under `.tmp-<name>` and renamed into place only once every rank's
files and meta.json are there, so a process killed mid-save leaves the previous one usable.
DCP reshards on load, so a checkpoint of N ranks resumes on M ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

from shardtune.checkpoint.folders import MODEL_FILES, complete_checkpoints, find_latest, read_meta, step_of
from shardtune.config.schema import CheckpointConfig
from shardtune.diskspace import free_bytes, human_size, no_room, tensor_bytes
from shardtune.errors import UserError, first_line
from shardtune.fsio import partial_name, sync_files, write_text_atomic

# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_rng(path: Path) -> dict:
    """A rank's saved RNG states, tried on the generators (then put back): a truncated, missing or
    foreign file is one line before the resume changes anything."""
    import torch

    now = rng_state()
    try:
        state = torch.load(path, weights_only=True)
        set_rng_state(state)
    except Exception as exc:  # noqa: BLE001 - a truncated pickle, a wrong structure, an unreadable file
        raise UserError(f"checkpoint {str(path.parent)!r} has a damaged {path.name} ({type(exc).__name__}: "
                        f"{first_line(exc, 120)}); use another checkpoint") from None
    finally:
        set_rng_state(now)
    return state


# ----------------------------------------------------------------------------- save and load


class ModelOptimizerState:
    """The sharded model and its optimizer as one state object for DCP (every rank writes and
    reads only its shards). On load the optimizer's moments and step counts come from the
    checkpoint, its hyperparameters from the current config (they may change on resume).
    With `hf_config` (checkpoint.hf_format), `save_hf` writes the model's weights into the
    checkpoint folder as Hugging Face safetensors, by every rank (checkpoint.hf_sharded); the
    Checkpointer then leaves them out of DCP, and dcp_load reads them back from there."""

    def __init__(self, model, optimizer, hf_config=None):
        self.model, self.optimizer, self.hf_config = model, optimizer, hf_config
        if hf_config is not None:  # refused now, not at the first checkpoint
            from shardtune.checkpoint.hf_sharded import require_hf_writable

            require_hf_writable(model, hf_config)

    def save_hf(self, folder: Path) -> None:
        """Collective: the model's weights (+ index) into `folder`, as save_pretrained lays them out."""
        from shardtune.checkpoint.hf_sharded import save_hf_sharded

        save_hf_sharded(self.model, self.hf_config, None, folder)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group, hyper in zip(self.optimizer.param_groups, fresh, strict=True):
            group.update(hyper)


class Checkpointer:
    """Saves and restores explicit state objects; it knows nothing of the trainer.

    - `tensors`: a state object whose state_dict holds the (sharded) tensors, written with DCP;
    - `states`: small named state objects (training progress, gradient scaler) whose state_dicts
      are JSON, kept in meta.json by rank 0;
    - `describe(step)`: rank 0, at save time: what else meta.json records (the run config, the
      data position) for resume checks and people, not loaded back;
    - `write_extras(folder)`: rank 0, at commit: files beside the shards (HF config, tokenizer);
    - `committed(folder, step)`: rank 0, once a checkpoint is complete in its final place.
    Each rank's RNG states are saved too. At most one save is in flight.
    """

    def __init__(self, root: Path, cfg: CheckpointConfig, tensors, states: dict, describe=None, write_extras=None,
                 committed=None):
        import torch.distributed as dist

        self.root, self.cfg = Path(root), cfg
        self.tensors, self.states = tensors, states
        self.describe = describe or (lambda step: {})
        self.write_extras = write_extras or (lambda folder: None)
        self.committed = committed or (lambda folder, step: None)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pending = None  # (future or None, tmp folder, meta)
        self.size = 0  # bytes of the last save, all ranks (for a full disk's message)
        self.rng = None  # this rank's RNG states from the checkpoint we resumed on the same world size
        # The async writer runs collectives from a thread: it needs a group of its own, or its
        # messages would interleave with the training step's.
        self.pg = dist.new_group(backend="gloo") if cfg.async_save else None

    def due(self, step: int, steps_per_epoch: int) -> bool:
        c = self.cfg
        return bool(c.every_steps and step % c.every_steps == 0) or (c.at_epoch_end and step % steps_per_epoch == 0)

    def save(self, step: int) -> Path:
        """Collective. Returns the folder the checkpoint will have once committed."""
        import torch
        import torch.distributed.checkpoint as dcp

        self.wait()
        name = f"step-{step:06d}"
        tmp = self.root / f".tmp-{name}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            rng = tmp / f"rng-rank{self.rank:05d}.pt"
            torch.save(rng_state(), rng)
            sync_files([rng])  # by its own rank: on another node, rank 0 could not
            meta = self._meta(step)  # now: an async save is written while training moves on
            tensors = self.tensors.state_dict()
            self.size = tensor_bytes(tensors) * self.world_size  # FSDP shards evenly
            if self.cfg.hf_format:  # the model as HF safetensors (from_pretrained loads the folder), the rest DCP
                self.tensors.save_hf(tmp)
                tensors = {k: v for k, v in tensors.items() if k != "model"}
            if self.pg is not None:
                future = dcp.async_save(tensors, checkpoint_id=tmp, process_group=self.pg)
                self.pending = (future, tmp, meta)
            else:
                dcp.save(tensors, checkpoint_id=tmp)
                self.pending = (None, tmp, meta)
                self._commit()
        except BaseException as exc:  # noqa: B036 - DCP's CheckpointException is a BaseException
            self._failed(exc, tmp)
        return self.root / name

    def _meta(self, step: int) -> dict:
        from shardtune import __version__

        hf = self.cfg.hf_format
        return {"format": 3 if hf else 2, "shardtune_version": __version__, "step": step, "world_size": self.world_size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model_files": MODEL_FILES[hf],
                **{name: state.state_dict() for name, state in self.states.items()}, **self.describe(step)}

    def poll(self) -> None:
        """Commit a finished async save; cheap, call once per step."""
        if self.pending is not None and self.pending[0] is not None and self.pending[0].done():
            self._commit()

    def wait(self) -> None:
        if self.pending is not None:
            self._commit()

    def _commit(self) -> None:
        tmp = self.pending[1]
        try:
            self._write_rest(*self.pending)
        except BaseException as exc:  # noqa: B036
            self._failed(exc, tmp)

    def _failed(self, exc: BaseException, tmp: Path) -> None:
        """A save that ran out of room: its partial folder goes, `latest` stays, one line."""
        self.pending = None
        if isinstance(exc, (UserError, KeyboardInterrupt, SystemExit)):
            raise exc
        need, free = self.size, free_bytes(self.root)
        reason = no_room(exc, need, free)
        if reason is None:
            raise exc
        shutil.rmtree(tmp, ignore_errors=True)
        partial_name(self.root / "latest").unlink(missing_ok=True)  # if `latest` was being replaced
        good = find_latest(self.root)
        raise UserError(f"{reason} while saving {tmp.name.removeprefix('.tmp-')} in {self.root}: a checkpoint needs "
                        f"about {human_size(need)}, {human_size(free)} is free; the partial save was removed, "
                        f"{f'the last good checkpoint is {good}' if good else 'no checkpoint was written'}; "
                        f"{'raise the limit, ' if 'ulimit' in reason else 'free space, lower checkpoint.keep_last, '}"
                        "or use an output_dir with more room") from None

    def _write_rest(self, future, tmp: Path, meta: dict) -> None:
        self.pending = None
        if future is not None:
            future.result()  # every rank's shards are written once the coordinator's future is done
        if self.rank != 0:
            return
        self.write_extras(tmp)
        # on disk before meta.json says the checkpoint is whole (a power loss kept the mark, not an empty
        # rng file or config): the extras, hf_format's index; DCP synced its own files
        sync_files(p for p in tmp.rglob("*") if p.is_file() and p.suffix != ".distcp" and p.name != ".metadata")
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=1) + "\n", sync=True)  # last: marks it complete
        final = self.root / tmp.name.removeprefix(".tmp-")
        trash = self.root / f".old-{final.name}"
        if final.exists():  # resumed from an older checkpoint: this step is written again
            os.rename(final, trash)
        os.rename(tmp, final)
        write_text_atomic(self.root / "latest", final.name + "\n", sync=True)
        shutil.rmtree(trash, ignore_errors=True)
        # keep_last counts this run's checkpoints, up to this one: later steps are what a resume from an
        # earlier checkpoint left behind (each replaced once the run reaches its step), and counting them
        # removed this run's own (keep_last=2 after a resume from step 4 of 3,4,6,8,9: new 8, old 9 kept)
        keep, ours = self.cfg.keep_last, [p for p in complete_checkpoints(self.root) if step_of(p) <= meta["step"]]
        for old in ours[:-keep] if keep else []:
            shutil.rmtree(old, ignore_errors=True)
        self.committed(final, meta["step"])

    def load(self, path: str | Path) -> dict:
        """Collective: restore the tensors and the states from `path`; returns its meta.json.
        This rank's RNG states are kept for `restore_rng` when the world size is the same."""
        path = Path(path)
        meta = read_meta(path)
        tensors = self.tensors.state_dict()
        resharded = meta["world_size"] != self.world_size
        dcp_load(tensors, path, no_dist=False,
                 refused=(lambda why: reshard_refusal(path, meta, self.world_size, why)) if resharded else None)
        self.tensors.load_state_dict(tensors)
        for name, state in self.states.items():
            if meta.get(name) is not None:
                state.load_state_dict(meta[name])
        if meta["world_size"] == self.world_size:
            self.rng = read_rng(path / f"rng-rank{self.rank:05d}.pt")
        return meta

    def restore_rng(self, reseed: int | None) -> None:
        """Call where a fresh run seeds its training RNG: the saved streams of this rank, or,
        when the checkpoint came from another world size, a fresh seed `reseed`."""
        import torch

        if self.rng is not None:
            set_rng_state(self.rng)
        elif reseed is not None:
            torch.manual_seed(reseed)

    def close(self) -> None:
        import torch.distributed as dist

        self.wait()
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None


def reshard_refusal(path: Path, meta: dict, world_size: int, why: str) -> str:
    """The line for a checkpoint of another world size that DCP could not reshard onto this one: it
    is not damaged. torchao's 8bit/4bit moments are quantized in blocks of a rank's shard, which new
    shard bounds may cut (a row length not a multiple of the block); resuming on its ranks works."""
    saved, state = meta["world_size"], meta["config"].get("train", {}).get("optimizer_state")
    blocks = (f"; its train.optimizer_state={state} moments are quantized in blocks of each rank's shard, which "
              f"the shards of {world_size} rank(s) cut") if state in ("8bit", "4bit") else ""
    return (f"checkpoint {str(path)!r}, written by {saved} rank(s), could not be resharded onto {world_size} "
            f"({why}){blocks}; resume it on {saved} rank(s) (--nproc {saved})")


def dcp_load(state: dict, path: Path, no_dist: bool, refused=None) -> None:
    """dcp.load in place, with a damaged or mismatched checkpoint as a one-line UserError
    (`refused(why)`: that line, where the caller knows better than "damaged"). A checkpoint
    written with checkpoint.hf_format holds its model in safetensors: the "model" part is read
    from those (every reader of checkpoints comes through here), the rest from DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if "model" in state and read_meta(path).get("model_files") == MODEL_FILES[True]:
        from shardtune.checkpoint.hf_sharded import read_model_part

        read_model_part(state["model"], path, no_dist)
        state = {k: v for k, v in state.items() if k != "model"}  # the same nested dicts: filled in place
        if not state:
            return
    read_dcp_metadata(path)
    try:
        with warnings.catch_warnings(), quiet_dcp_logs():  # "assuming the intent is to load in a single
            warnings.simplefilter("ignore", UserWarning)  # process": it is
            dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    except (CheckpointException, Exception) as exc:  # CheckpointException is a BaseException
        cause = next(iter((getattr(exc, "failures", None) or {}).values()), exc)  # rank -> (exception, traceback)
        cause = cause[0] if isinstance(cause, tuple) else cause
        why = f"{type(cause).__name__}: {first_line(cause, 160, last=True)}"
        raise UserError(refused(why) if refused else f"checkpoint {str(path)!r} could not be loaded ({why}); it is "
                        "damaged or from another model: use another checkpoint") from None


def read_dcp_metadata(path: Path):
    """The checkpoint's DCP index (.metadata), or one line saying it is damaged: read before
    dcp.load, which logs a warning with a traceback per failed read before its own error."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with quiet_dcp_logs():
            return FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated pickle, a wrong type, an unreadable file
        raise UserError(f"checkpoint {str(path)!r} has a damaged .metadata ({type(exc).__name__}: "
                        f"{first_line(exc, 120)}); use another checkpoint") from None


@contextlib.contextmanager
def quiet_dcp_logs():
    """torch.distributed.checkpoint's logger silenced: a refused checkpoint is one line, ours."""
    import logging

    logger = logging.getLogger("torch.distributed.checkpoint")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
