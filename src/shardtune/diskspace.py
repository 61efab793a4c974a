"""Disk space for checkpoints: how big one is, whether the disk can hold what a run keeps, and
whether a failed save ran out of room (a full disk, a quota, or `ulimit -f`)."""

from __future__ import annotations

import errno
import resource
import shutil
from pathlib import Path

NO_SPACE = {errno.ENOSPC: "No space left", errno.EDQUOT: "Disk quota", errno.EFBIG: "File too large"}


def no_room(exc: BaseException, need: int, free: int | None) -> str | None:
    """Why a failed save had no room ("disk full", "file size limit reached"), or None when the
    failure is something else. DCP wraps each rank's failure in its own exception, and
    torch.save's zip writer keeps no errno, so a full disk or a `ulimit -f` below the
    checkpoint's size also count."""
    found = {code for e in causes(exc) for code, text in NO_SPACE.items()
             if (isinstance(e, OSError) and e.errno == code) or text in str(e)}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if errno.EFBIG in found or limit != resource.RLIM_INFINITY and limit < need:
        return "file size limit reached (ulimit -f)"
    if found or (free is not None and free < need):
        return "disk full"
    return None


def causes(exc: BaseException):
    """`exc` and every exception behind it: causes, contexts, and each rank's failure that DCP
    wraps in one CheckpointException (its `failures`)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        wrapped = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
        todo += [e.__cause__, e.__context__, *wrapped]


def tensor_bytes(tree) -> int:
    """Bytes of the local shards of a tensor, or of the tensors in a nested dict or list (None
    and non-tensors count 0). The one count of tensor bytes: checkpoints, telemetry, warnings."""
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    local = tree.to_local() if hasattr(tree, "to_local") else tree
    return local.numel() * local.element_size() if hasattr(local, "element_size") else 0


def checkpoint_bytes(model, world_size: int) -> int:
    """About the size of one checkpoint of all ranks: every parameter, plus AdamW's two fp32
    states per trainable one (local shards x ranks, as FSDP shards evenly)."""
    # AdamW: two fp32 moments per element of each trainable local shard
    adam = sum(tensor_bytes(p) // p.element_size() * 8 for p in model.parameters() if p.requires_grad)
    return (tensor_bytes(list(model.parameters())) + adam) * world_size


def space_warning(root: Path, cfg, size: int, total_steps: int, steps_per_epoch: int) -> str | None:
    """A start-up warning when the disk cannot hold the checkpoints the run keeps at once while
    it writes the next (keep_last + 1), else None."""
    planned = (total_steps // cfg.every_steps if cfg.every_steps else 0) + \
        (total_steps // steps_per_epoch if cfg.at_epoch_end else 0)
    count = max(1, min(cfg.keep_last + 1, planned) if cfg.keep_last else planned)
    free = free_bytes(root)
    if free is None or free >= count * size:
        return None
    return (f"warning: {root} has {human_size(free)} free, less than the {count} checkpoint(s) of about "
            f"{human_size(size)} this run holds at once (checkpoint.keep_last={cfg.keep_last} plus the one being "
            "written); free "
            "space, lower checkpoint.keep_last, or use an output_dir with more room")


def free_bytes(path: Path) -> int | None:
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human_size(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
