"""What a step with a NaN/inf loss or gradient tells (the update itself was not applied,
train.step): which parameters' gradients are not finite (step.GradNorms.nonfinite), the step's
samples and the documents in them, so a bad document can be found, and with on_nan=stop the fix."""

from __future__ import annotations

from shardtune.data.batches import describe_samples, format_samples
from shardtune.errors import UserError


def met(trainer, step: int, loss: float, grad_norm: float, grad_norms) -> dict:
    """A NaN/inf loss or gradient in `trainer`'s step (the update was not applied, train_step): stop,
    saying where it came from, or go on, returning that for the metrics record (on_nan=skip)."""
    found = origin(trainer.model, trainer.dist.world_size, trainer.train_ds, trainer.plan.global_indices(step - 1),
                   grad_norms)
    what = describe(found, step, loss, grad_norm)
    if trainer.cfg.on_nan == "skip":
        trainer.say(f"warning: {what}; skipped that update (on_nan=skip)")
        return found
    trainer.ckpt.wait()
    from shardtune.checkpoint.folders import find_latest

    raise UserError(stop_line(what, step, find_latest(trainer.out / "checkpoints")))


def origin(model, world_size: int, ds, indices: list[int], grad_norms) -> dict:
    """Where a non-finite step came from, as the metrics record keeps it (on_nan=skip)."""
    bad = grad_norms.nonfinite(model, world_size) if grad_norms else None
    return {"nonfinite_grads": bad, **describe_samples(ds, indices)}


def describe(origin: dict, step: int, loss: float, grad_norm: float) -> str:
    """`origin` in words, after the numbers that were not finite."""
    bad = origin["nonfinite_grads"]
    grads = "every gradient finite" if bad is None else \
        f"non-finite gradients in {bad['count']} parameters, from {bad['first']} to {bad['last']} (model order), " \
        f"beginning in {bad['block']} at {', '.join(bad['entry'])}"
    return f"loss {loss} / gradient norm {grad_norm} at step {step} ({grads}; samples {format_samples(origin)})"


def stop_line(what: str, step: int, good_checkpoint) -> str:
    """on_nan=stop's one line: `what` (describe), the last good checkpoint, the fix."""
    where = f"the last good checkpoint is {good_checkpoint}" if good_checkpoint else "no checkpoint was written"
    # step 1 computes on the starting weights: no learning rate has acted yet, so the model
    # (its config's eps or rope_theta, its weights) or the samples made the NaN, not train.lr
    fix = "lower train.lr or set on_nan=skip" if step > 1 else \
        "no update came before it, so not train.lr: check the model's config and weights (e.g. a norm eps or " \
        "rope_theta of 0 or less) and the samples named"
    return f"{what}; stopped without applying it (on_nan=stop), {where}; {fix}"
