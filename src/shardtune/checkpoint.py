"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of OUTPUT_DIR/checkpoints/:

    step-000120/             one complete checkpoint, named by optimizer step
      .metadata, *.distcp    DCP: model + optimizer; every rank writes only its own shards
      rng-rank00000.pt       that rank's RNG states (python, numpy, torch, cuda)
      config.json tokenizer/ the HF model config and tokenizer: export/eval/generate need nothing else
      meta.json              step, epoch, data position, world size, scheduler/scaler, run config
    latest                   name of the newest complete checkpoint (replaced atomically)
    .tmp-step-000130/        a save in progress, or one killed mid-way (ignored, removed on restart)

A checkpoint is written under `.tmp-<name>` and renamed into place only once every rank's
files and meta.json are there, so a process killed mid-save leaves the previous one usable.
DCP reshards on load, so a checkpoint of N ranks resumes on M ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

from .diskspace import checkpoint_bytes, free_bytes, human_size, no_room
from .errors import UserError, first_line

FORMAT = 1
NAME = re.compile(r"^step-(\d+)$")
# Changing these breaks resume: the weights' shapes, or what "step N" means in the data order.
# Whole sections are compared, so a key added to one later is covered without a change here.
RESUME_KEYS = ("model.name_or_path", "model.config", "model.tokenizer", "data", "train.global_batch_size",
               "train.seed", "peft", "freeze")
MAY_CHANGE = {"data.num_proc", "peft.dropout"}  # inside those sections, but harmless


# ----------------------------------------------------------------------------- finding


def step_of(path: Path) -> int:
    m = NAME.match(path.name)
    return int(m.group(1)) if m else -1


def is_complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) >= 0 and is_complete(p)), key=step_of)


def find_latest(root: Path) -> Path | None:
    """`latest` if it names a complete checkpoint, else the complete one with the highest step."""
    try:
        named = root / (root / "latest").read_text().strip()
        if named.name and is_complete(named):
            return named
    except OSError:
        pass
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, or a one-line UserError saying what is wrong with it."""
    if not path.exists():
        raise UserError(f"checkpoint {str(path)!r} not found; give a checkpoint folder "
                        "(OUTPUT_DIR/checkpoints/step-N) or a run's output_dir")
    if not (path / "meta.json").is_file() or not (path / ".metadata").is_file():
        raise UserError(f"{str(path)!r} is not a complete shardtune checkpoint (meta.json or .metadata missing: "
                        "an interrupted save?); use another checkpoint of the run")
    try:
        meta = json.loads((path / "meta.json").read_text())
        meta["step"], meta["config"]  # noqa: B018 - the keys everything below relies on
    except (ValueError, KeyError, TypeError):
        raise UserError(f"checkpoint {str(path)!r} is corrupt (unreadable meta.json); use another checkpoint") from None
    if meta.get("format", 0) > FORMAT:
        raise UserError(f"checkpoint {str(path)!r} was written by a newer shardtune "
                        f"({meta.get('shardtune_version')}); upgrade shardtune")
    return meta


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint folder, or the newest complete checkpoint of a run folder."""
    path = Path(spec).expanduser()
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if root.is_dir() and not (path / "meta.json").exists() and (root != path or path.name == "checkpoints"):
        latest = find_latest(root)
        if latest is None:
            raise UserError(f"{str(root)!r} holds no complete checkpoint; give another checkpoint or start over")
        return latest
    read_meta(path)
    return path


def check_compatible(saved: dict, now: dict, path: Path) -> None:
    """Refuse a resume whose config changes what the checkpoint holds; anything else may change."""
    def get(tree, key):
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    changed = []
    for key in RESUME_KEYS:
        old, new = get(saved, key), get(now, key)
        if isinstance(old, dict) and isinstance(new, dict):  # name the changed sub-keys only
            changed += [f"{key}.{k} {short(old.get(k))} -> {short(new.get(k))}"
                        for k in sorted(old.keys() | new.keys())
                        if old.get(k) != new.get(k) and f"{key}.{k}" not in MAY_CHANGE]
        elif old != new:
            changed.append(f"{key} {short(old)} -> {short(new)}")
    if changed:
        raise UserError(f"cannot resume from {str(path)!r}: {'; '.join(changed)} changed; resume with the "
                        "checkpoint's values (lr, max_steps, eval and log settings may change) or use a new output_dir")


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
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


# ----------------------------------------------------------------------------- save and load


class Checkpointer:
    """Saves and restores one Trainer's state. At most one save is in flight."""

    def __init__(self, trainer):
        import torch.distributed as dist

        self.t = trainer
        self.cfg = trainer.cfg.checkpoint
        self.root = trainer.out / "checkpoints"
        self.pending = None  # (future or None, tmp folder, meta)
        self.rng = None  # this rank's RNG states from the checkpoint we resumed
        self.reseed = False
        # The async writer runs collectives from a thread: it needs a group of its own, or its
        # messages would interleave with the training step's.
        self.pg = dist.new_group(backend="gloo") if self.cfg.async_save else None

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.t.model, self.t.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def due(self, step: int) -> bool:
        c, spe = self.cfg, self.t.plan.steps_per_epoch
        return bool(c.every_steps and step % c.every_steps == 0) or (c.at_epoch_end and step % spe == 0)

    def save(self, step: int) -> Path:
        """Collective. Returns the folder the checkpoint will have once committed."""
        import torch
        import torch.distributed.checkpoint as dcp

        self.wait()
        t, name = self.t, f"step-{step:06d}"
        tmp = self.root / f".tmp-{name}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save(rng_state(), tmp / f"rng-rank{t.dist.rank:05d}.pt")
            meta = self._meta(step)  # now: the scheduler moves on while an async save is written
            if self.pg is not None:
                future = dcp.async_save(self._state(), checkpoint_id=tmp, process_group=self.pg)
                self.pending = (future, tmp, meta)
            else:
                dcp.save(self._state(), checkpoint_id=tmp)
                self.pending = (None, tmp, meta)
                self._commit()
        except BaseException as exc:  # noqa: B036 - DCP's CheckpointException is a BaseException
            self._failed(exc, tmp)
        return self.root / name

    def _meta(self, step: int) -> dict:
        from . import __version__

        t, spe, gb = self.t, self.t.plan.steps_per_epoch, self.t.cfg.train.global_batch_size
        epoch, in_epoch = divmod(step, spe)
        d = t.cfg.data
        return {
            "format": FORMAT, "shardtune_version": __version__, "step": step, "epoch": step / spe,
            "tokens_seen": t.tokens_seen, "world_size": t.dist.world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # Position in the seeded global order (data.BatchPlan): enough to continue exactly.
            "data": {"start_idx": d.start_idx, "end_idx": d.end_idx, "sequences_per_epoch": t.plan.num_samples,
                     "epoch": epoch, "samples_into_epoch": in_epoch * gb, "samples_consumed": step * gb},
            "scheduler": t.scheduler.state_dict(),
            "scaler": t.scaler.state_dict() if t.scaler is not None else None,
            "config": t.cfg.to_dict(),
        }

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
        need, free = checkpoint_bytes(self.t.model, self.t.dist.world_size), free_bytes(self.root)
        reason = no_room(exc, need, free)
        if reason is None:
            raise exc
        shutil.rmtree(tmp, ignore_errors=True)
        (self.root / ".latest.tmp").unlink(missing_ok=True)  # `_write_atomic`'s, if `latest` was being replaced
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
        if not self.t.dist.is_main:
            return
        self.t.hf_config.save_pretrained(tmp)
        self.t.tokenizer.save_pretrained(tmp / "tokenizer")
        _write_atomic(tmp / "meta.json", json.dumps(meta, indent=1) + "\n")  # last: marks it complete
        final = self.root / tmp.name.removeprefix(".tmp-")
        trash = self.root / f".old-{final.name}"
        if final.exists():  # resumed from an older checkpoint: this step is written again
            os.rename(final, trash)
        os.rename(tmp, final)
        _write_atomic(self.root / "latest", final.name + "\n")
        shutil.rmtree(trash, ignore_errors=True)
        keep = self.cfg.keep_last
        for old in complete_checkpoints(self.root)[:-keep] if keep else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: str | Path) -> dict:
        """Collective: restore model, optimizer, scheduler, scaler and step from `path`."""
        import torch
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t, path = self.t, Path(path)
        meta = read_meta(path)
        # Hyperparameters come from the current config (lr may change); the state from the checkpoint.
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups]
        state = self._state()
        dcp_load(state, path, no_dist=False)
        set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group, hyper in zip(t.optimizer.param_groups, fresh):
            group.update(hyper)
        sched = t.scheduler
        sched.load_state_dict(meta["scheduler"])
        sched.base_lrs = [g["initial_lr"] for g in t.optimizer.param_groups]
        sched._last_lr = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(t.optimizer.param_groups, sched._last_lr):
            group["lr"] = lr
        if t.scaler is not None and meta.get("scaler"):
            t.scaler.load_state_dict(meta["scaler"])
        t.step, t.tokens_seen = meta["step"], meta.get("tokens_seen", 0)
        if meta["world_size"] == t.dist.world_size:
            self.rng = torch.load(path / f"rng-rank{t.dist.rank:05d}.pt", weights_only=True)
        else:
            self.reseed = True
            t.say(f"checkpoint written by {meta['world_size']} rank(s), resuming on {t.dist.world_size}: "
                  "model, optimizer and data order carry over; RNG streams (dropout) are re-seeded from seed+step+rank")
        return meta

    def restore_rng(self) -> None:
        """Call where a fresh run seeds its training RNG."""
        import torch

        if self.rng is not None:
            set_rng_state(self.rng)
        elif self.reseed:
            torch.manual_seed(self.t.cfg.train.seed + 1_000_003 * self.t.step + self.t.dist.rank)

    def close(self) -> None:
        import torch.distributed as dist

        self.wait()
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None


def dcp_load(state: dict, path: Path, no_dist: bool) -> None:
    """dcp.load in place, with a damaged or mismatched checkpoint as a one-line UserError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    except (CheckpointException, Exception) as exc:  # CheckpointException is a BaseException
        cause = next(iter((getattr(exc, "failures", None) or {}).values()), exc)  # rank -> (exception, traceback)
        cause = cause[0] if isinstance(cause, tuple) else cause
        raise UserError(f"checkpoint {str(path)!r} could not be loaded ({type(cause).__name__}: "
                        f"{first_line(cause, 160, last=True)}); it is damaged or from "
                        "another model: use another checkpoint") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
