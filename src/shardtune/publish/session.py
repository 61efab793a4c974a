"""What a run sends off the machine, in one place for the trainer: at each committed checkpoint
and at the end, the Hub uploads (rank 0's HubPublisher) and the trackers' artifacts (W&B)."""

from __future__ import annotations

from pathlib import Path

from shardtune.publish.hub import HubPublisher


class Publishing:
    """One per rank (only rank 0's does anything), once the run's check (`check.run`: a Hub
    token at hand, `hub`) passed. `trackers` is set once the trainer opens them."""

    def __init__(self, cfg, out: Path, hub: bool, is_main: bool, say=print, resuming: bool = False):
        from shardtune.checkpoint.folders import complete_checkpoints, step_of

        self.cfg, self.trackers = cfg, None
        self.hub = HubPublisher(cfg.publish, out, say, resuming) if hub and is_main else None
        if self.hub and cfg.peft.adapter:
            from shardtune.publish.adapter_base import adapter_hub_base

            self.hub.adapter_base, warning = adapter_hub_base(cfg.model, cfg.peft)
            if warning:
                say(warning)
        if self.hub:
            for folder in complete_checkpoints(out / "checkpoints"):  # a resume: what is not uploaded yet
                self.hub.checkpoint(folder, step_of(folder))

    def committed(self, folder: Path, step: int) -> None:
        """Rank 0, a checkpoint complete on disk: publish it (uploads in the background)."""
        if self.hub:
            self.hub.checkpoint(folder, step)
        if self.trackers:
            self.trackers.artifact(folder, step, final=False)

    def final(self, folder: Path | None, step: int, results: dict) -> None:
        """The end of the run (`folder`: final/, or None when there is none, e.g. preempted): the
        final model as an artifact and to the Hub with its card, then wait for uploads in flight."""
        if self.trackers:
            if folder is not None:
                self.trackers.artifact(folder, step, final=True)
            self.trackers.close()
        if self.hub:
            if folder is not None:
                from shardtune.config.load import dump_yaml
                from shardtune.publish.card import model_card

                self.hub.final(folder, step, model_card(self.cfg.to_dict(), step, results.get("last")),
                               dump_yaml(self.cfg))
            self.hub.finish(limit=None if folder is not None else 10.0)  # preempted: the resume goes on

    def close(self) -> None:
        if self.trackers:
            self.trackers.close()
