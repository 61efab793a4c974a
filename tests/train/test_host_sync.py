"""The step never waits for the device: no host synchronisation from shardtune's code between
a step's first forward and its update, and a non-finite update skipped on the device leaves
weights and optimizer state exactly as they were."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY, check_a_nonfinite_update_is_skipped, make_trainer, step, tiny_overrides

SRC = str(Path(__file__).resolve().parents[2] / "src" / "shardtune")
# ops whose result the host must read (.item(), bool(tensor), float(tensor)) or whose output
# shape depends on the data: on CUDA each waits for everything queued before it
READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}


class HostReads(TorchDispatchMode):
    """Records every op that makes the host wait for the device whose innermost frame outside
    torch lies in src/shardtune (others, transformers' own checks, are not ours to count)."""

    def __init__(self, everyone: bool = False):
        super().__init__()
        self.ours: list[str] = []
        self.everyone: list[str] | None = [] if everyone else None  # transformers' reads too

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in args[1] if i is not None)
        if name in READS or bool_index:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                          if "/torch/" not in f.filename and f.filename != __file__)
            if self.everyone is not None:
                self.everyone.append(f"{name} at {caller.filename}:{caller.lineno}")
            if caller.filename.startswith(SRC):
                self.ours.append(f"{name} at {Path(caller.filename).name}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def trainer(assets, tmp_path):
    torch.set_num_threads(1)
    t = make_trainer(assets, tmp_path, **{"data.format": "text"})
    yield t
    t.close()


def test_a_step_and_its_numbers_ask_the_host_nothing(trainer):
    from shardtune.train.step import queue_numbers, read_numbers

    prefetcher = trainer.prefetcher()
    try:
        with HostReads() as reads:
            # count_tokens: the tokens with a loss are counted and summed over ranks on the device
            numbers = [queue_numbers(step(trainer, prefetcher.take(s)[0]), 0, trainer.dist.device) for s in (0, 1)]
    finally:
        prefetcher.close()
    assert reads.ours == []  # transformers' own checks (padding warning, packed sequences) are not ours
    first = read_numbers(numbers[0])
    assert torch.isfinite(torch.tensor([first.loss, first.grad_norm])).all() and first.input_tokens > 0
    assert not first.stop


def test_a_nonfinite_update_is_skipped_on_the_device(trainer, monkeypatch):
    check_a_nonfinite_update_is_skipped(trainer, monkeypatch)


def test_the_loop_reads_a_step_once_the_next_is_queued(assets, tmp_path, monkeypatch):
    """Step N's numbers are read after step N+1's work is queued; a checkpoint step and the
    last step are read at once (a checkpoint records the exact tokens seen)."""
    import shardtune.train.trainer as train_mod
    from shardtune.config.load import load_config
    from shardtune.train.step import read_numbers, train_step

    events: list[str] = []

    def queued_step(*args, **kw):
        out = train_step(*args, **kw)
        events.append(f"queued {sum(e.startswith('queued') for e in events) + 1}")
        return out

    def read(numbers):
        events.append(f"read {sum(e.startswith('read') for e in events) + 1}")
        return read_numbers(numbers)

    monkeypatch.setattr(train_mod, "train_step", queued_step)
    monkeypatch.setattr(train_mod, "read_numbers", read)
    overrides = tiny_overrides(assets, tmp_path, **{"train.max_steps": 5, "checkpoint.every_steps": 3,
                                                    "eval.at_start": "false", "save_final": "false"})
    train_mod.run(load_config(None, overrides, defaults={}), overwrite=True)
    assert events == ["queued 1", "queued 2", "read 1", "queued 3", "read 2", "read 3",
                      "queued 4", "queued 5", "read 4", "read 5"]


def test_step_times_are_the_steps_own_though_read_late(assets, tmp_path, monkeypatch):
    """Read one step late, a record still times its own steps: the meter takes the StepClock
    marks queued before and behind each step, not the host's clock at reading (which, on a CPU,
    would include the next step and leave the last record at ~0), nor the time between steps:
    an evaluation or a checkpoint is no step's time. A fake clock ticks once a mark, and 100
    times in each evaluation and save."""
    import json

    import shardtune.telemetry.metrics as telemetry
    from shardtune.checkpoint.dcp import Checkpointer
    from shardtune.config.load import load_config
    from shardtune.train.trainer import Trainer, run

    ticks = iter(range(10_000))
    monkeypatch.setattr(telemetry.StepClock, "mark", lambda self: float(next(ticks)))
    def slow(real):
        def call(*args, **kw):
            for _ in range(100):
                next(ticks)
            return real(*args, **kw)
        return call

    monkeypatch.setattr(Trainer, "evaluate", slow(Trainer.evaluate))
    monkeypatch.setattr(Checkpointer, "save", slow(Checkpointer.save))
    overrides = tiny_overrides(assets, tmp_path, **{"train.max_steps": 7, "log.every_steps": 2,
                                                    "checkpoint.every_steps": 3, "eval.every_steps": 4,
                                                    "save_final": "false"})
    run(load_config(None, overrides, defaults={}), overwrite=True)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    timed = [(r["step"], r["step_time_s"]) for r in rows if "step_time_s" in r]
    assert timed == [(2, 1.0), (3, 1.0), (4, 1.0), (6, 1.0), (7, 1.0)]  # a record at the save (step 3)
    assert [r["tokens_per_s"] for r in rows if "tokens_per_s" in r] == [8 * 64] * 5  # 8 x 64 tokens a tick


@pytest.mark.parametrize("arch", sorted(TINY))
def test_a_packed_batch_reaches_the_model_without_an_attention_mask(assets, tmp_path, arch):
    """A mask that says nothing (packed blocks, rows of one length) is not passed: given one,
    transformers checks it on the host before every forward (`masking_utils`, a synchronisation
    on CUDA) and attention loses its causal kernels. OPT, whose forward needs no other check,
    then asks the host nothing at all (transformers before 5.18 made a mask of ones itself)."""
    trainer = make_trainer(assets, tmp_path, arch=arch)
    seen = []
    trainer.model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw.get("attention_mask", "absent")),
                                            with_kwargs=True)
    prefetcher = trainer.prefetcher()
    try:
        with HostReads(everyone=True) as reads:
            step(trainer, prefetcher.take(0)[0])
    finally:
        prefetcher.close()
        trainer.close()
    assert seen and all(mask is None for mask in seen)
    if arch == "opt":
        assert reads.everyone == []


def test_a_cuda_step_is_read_through_a_copy_queued_behind_it_not_behind_the_next(one_rank, monkeypatch):
    """On CUDA the host reads step N once step N+1 is queued. A copy to the host asked for then
    (`.tolist()` of the device tensor) is queued behind step N+1's work: the host waited for that
    step to end, and the device idled while the host queued N+2. The copy and an event are queued
    behind step N's numbers instead, and the reading waits for that event. A fake device: an event
    remembers what was queued before it, the tensors say they are CUDA's."""
    from shardtune.train.step import StepResult, queue_numbers, read_numbers

    queue, waited = [], []

    class Event:
        def record(self):
            self.after = list(queue)

        def synchronize(self):
            waited.append(self.after)

    def result(loss):
        return StepResult(torch.tensor(loss), 3.0, 4, 10, 0, torch.tensor(1.5))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    with monkeypatch.context() as fake:
        fake.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        queue.append("step 1")
        first = queue_numbers(result(6.0), 0, one_rank.device)
        queue.append("step 2")
        second = queue_numbers(result(9.0), 1, one_rank.device)
    assert (read_numbers(first).loss, read_numbers(second).loss) == (2.0, 3.0)
    assert waited == [["step 1"], ["step 1", "step 2"]]  # step 1's reading waited for step 1 alone
    assert read_numbers(queue_numbers(result(6.0), 0, one_rank.device)) == read_numbers(first)  # CPU: as it is
