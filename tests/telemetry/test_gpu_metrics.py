"""The CUDA-only telemetry paths on a CPU machine, through a fake NVML: which card a rank samples."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from shardtune.hardware import GIB
from shardtune.telemetry.metrics import GPUSampler


@pytest.fixture
def nvml(monkeypatch):
    """nvidia-ml-py as torch.cuda sees it: every card of the machine by NVML index; card i is
    busy 10 x i % and holds i GiB."""
    fake = types.ModuleType("pynvml")
    fake.NVMLError_DriverNotLoaded = type("NVMLError_DriverNotLoaded", (Exception,), {})
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda index: index
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10 * h, memory=0)
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=h * GIB)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "pynvml", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "_HAS_PYNVML", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch.cuda asks for the current
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # device, then uses the one given
    return fake


def sampled(device, tries: int = 1000) -> dict:
    """What the sampler reads once it has a sample (a sampler that is off: within `tries` ms)."""
    sampler = GPUSampler(device, interval=0.001)
    try:
        for _ in range(tries):
            if (got := sampler.read()):
                return got
            time.sleep(0.001)
        return {}
    finally:
        sampler.close()


@pytest.mark.parametrize("visible, index, card", [(None, 1, 1), ("2,3", 0, 2), ("2,3", 1, 3), ("5", 0, 5)])
def test_a_rank_samples_its_own_card_whatever_cuda_visible_devices_hides(nvml, monkeypatch, visible, index, card):
    """NVML numbers all the machine's cards, CUDA only the visible ones: a rank on cuda:0 of
    CUDA_VISIBLE_DEVICES=2,3 (a Slurm task, a shared node) reported card 0's load, another job's."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sampled(torch.device("cuda", index)) == {"gpu_util": 10.0 * card, "gpu_mem_used_gib": float(card)}


def test_sampling_is_off_without_nvml_or_off_a_gpu(nvml, monkeypatch):
    assert sampled(torch.device("cpu"), tries=50) == {}

    def no_driver():
        raise nvml.NVMLError_DriverNotLoaded()

    monkeypatch.setattr(nvml, "nvmlInit", no_driver)
    assert sampled(torch.device("cuda", 0), tries=50) == {}  # nothing sampled and nothing raised


def test_a_step_is_timed_though_its_numbers_were_read_before_its_end_mark_was_reached(monkeypatch):
    """The loop reads a step's numbers by waiting for the event behind their copy (train.step.HostCopy),
    queued just before the StepClock mark behind the step: the device may not have reached that mark
    yet, and CUDA's elapsed_time refuses an event not reached ("device not ready"). A fake device
    that reaches an event (and all before it) only when the host waits for it."""
    from shardtune.telemetry.metrics import StepClock

    queued: list = []

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.reached = False

        def record(self):
            self.at = len(queued) * 0.25  # a quarter of a second per event queued
            queued.append(self)

        def synchronize(self):
            for event in queued[:queued.index(self) + 1]:
                event.reached = True

        def elapsed_time(self, end) -> float:
            if not (self.reached and end.reached):
                raise RuntimeError("CUDA error: device not ready")
            return (end.at - self.at) * 1000

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = StepClock(torch.device("cuda", 0))
    began = clock.mark()
    copied = Event()
    copied.record()
    done = clock.mark()
    copied.synchronize()  # the host reads the step's numbers
    assert clock.seconds(began, done) == 0.5
