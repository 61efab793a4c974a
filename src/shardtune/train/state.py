"""What the training loop carries between steps, as explicit objects: the seeded RNGs, the
train state every checkpoint saves, a step whose numbers are still on the device, and the parts
one `fit` assembles for the loop."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """Where training stands, beyond weights and optimizer: the step (the learning rate and the
    data order are functions of it) and the tokens trained on. Saved in every checkpoint."""

    step: int = 0
    tokens_seen: float = 0.0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), float(state.get("tokens_seen", 0.0))


@dataclass
class QueuedStep:
    """An optimizer step whose work is queued on the device, and what the host will read of it."""

    step: int
    lr: float
    data_seconds: float  # the loop's wait for this step's batches
    numbers: object  # step.HostCopy of step.queue_numbers: on CUDA, maybe still on its way
    began: float | torch.cuda.Event  # telemetry.StepClock mark queued before the step asked for its batches
    done: float | torch.cuda.Event  # telemetry.StepClock mark queued behind the step
    watch: object = None  # step.HostCopy of log.watch's per-block norms: on CUDA, maybe still on its way
    grad_norms: object = None  # step.GradNorms: read only when the step was not finite


@dataclass
class LoopParts:
    """What one `Trainer.fit` assembles for its loop (metrics file, trackers, progress bar, GPU
    sampler, stop request, batch prefetcher, profiler), closed together in reverse order."""

    log: Any
    trackers: Any
    progress: Any
    gpu: Any
    preemption: Any
    prefetcher: Any
    profiler: Any

    def close(self) -> None:
        """The trackers stay open: publishing logs the final model to them."""
        self.profiler.close()
        self.prefetcher.close()
        self.preemption.restore()
        self.progress.close()
        self.log.close()
        self.gpu.close()
