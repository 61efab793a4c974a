"""What a resume checks and says once its checkpoint is read, before the run folder changes."""

from __future__ import annotations

from shardtune.errors import UserError
from shardtune.train.optim import schedule_change


def resume_notes(meta: dict, t, step: int, total_steps: int, steps_per_epoch: int, world_size: int,
                 path) -> list[str]:
    """The start-up lines of a resume from the checkpoint `meta` describes (at `step`), or one
    UserError where nothing would train. `t` is the run's train config."""
    if step > total_steps:  # train.max_steps is checked with the folder; epochs need the data
        raise UserError(f"train.epochs={t.epochs:g} is {total_steps} step(s) of this data, below the step of "
                        f"the checkpoint it resumes ({step}, {path!r}): nothing would train; "
                        "raise train.epochs or set train.max_steps, or start over in a new output_dir")
    notes = []
    if note := schedule_change(meta["config"].get("train", {}), t, step, steps_per_epoch):
        notes.append(note)
    if meta["world_size"] != world_size:
        notes.append(f"checkpoint written by {meta['world_size']} rank(s), resuming on {world_size}: model, "
                     "optimizer and data order carry over; RNG streams (dropout) are re-seeded from seed+step+rank")
    return notes


def data_record(cfg, plan, ds, step: int) -> dict:
    """What a checkpoint at `step` records of the data: the sequences its next step trains
    (data.batches.batch_key; a resume checks them, and the count), and the position in the seeded
    data order (`plan`, a data.batches.BatchPlan over `ds`), for people."""
    from shardtune.data.batches import batch_key

    epoch, in_epoch = divmod(step, plan.steps_per_epoch)
    gb = cfg.train.global_batch_size
    return {"start_idx": cfg.data.start_idx, "end_idx": cfg.data.end_idx, "sequences_per_epoch": plan.num_samples,
            "epoch": epoch, "samples_into_epoch": in_epoch * gb, "samples_consumed": step * gb,
            "next_batch": batch_key(ds, plan, step)}


def check_resume_data(resume_from, plan, ds) -> None:
    """Refuse a resume from `resume_from` whose data is not its checkpoint's (checkpoint.folders.check_same_data)."""
    from pathlib import Path

    from shardtune.checkpoint.folders import check_same_data, read_meta
    from shardtune.data.batches import batch_key

    saved = read_meta(Path(resume_from))
    check_same_data(saved, plan.num_samples, batch_key(ds, plan, saved["step"]), resume_from)
