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
