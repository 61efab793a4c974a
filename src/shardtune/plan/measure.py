"""A real training step measured, what `trace.trace_step` predicts: the planner's accuracy checks
(bench/plan_accuracy.py, tests/plan) compare the two.

On CPU the measure is the allocator's: every byte the step allocates and frees on this rank,
from torch profiler's memory events, on top of the tensors held when it starts (parameters,
optimizer state). It sees what a tensor-level count (torch's MemTracker, which sees the
operators the step calls, not what runs inside them) misses: the copies a collective makes
inside the backend (gloo clones a reduce-scatter's input). On CUDA it is the caching allocator's
peak of allocated bytes (torch.cuda.max_memory_allocated). Neither runs the step under a
dispatch mode, which changes it: autograd then sums a tensor's gradients out of place (one
vocab x hidden more at a tied embedding).
"""

from __future__ import annotations

import torch

from shardtune.config.schema import RunConfig


def measure_step(cfg: RunConfig, hf_config, dist, state_only: bool = False, optimizer_only: bool = False) -> int:
    """Peak bytes held during one steady training step of `cfg`, really run on this rank of the
    current process group: the optimizer state made first (as traced: fp16's gradient scaler may
    skip the first real steps, and a skipped step makes none), a first step run, the second measured.
    Collective. `state_only`: the bytes of the optimizer state after the first step instead
    (on CUDA torchao's compiled step refuses to run under MemTracker's dispatch mode, so a
    low-precision state is measured this way). `optimizer_only` (CPU): the peak of the second
    step's optimizer step alone (the optimizer phase of a trace)."""

    from shardtune.config.load import check_world
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.model.hf import load_source_model
    from shardtune.plan.trace import create_optimizer_state, shape_only_batches
    from shardtune.train.optim import build_grad_scaler, build_optimizer
    from shardtune.train.step import train_step

    accum = check_world(cfg, dist.world_size)
    built = build_model(ModelSpec.of_run(cfg, hf_config), build_mesh(cfg.fsdp, dist), dist.device,
                        source=lambda: load_source_model(cfg.model, hf_config, cfg.train.seed), seed=cfg.train.seed)
    model = built.model.train()
    optimizer = build_optimizer(model, cfg.train, dist.device, cfg.precision, cfg.peft.lora_plus_ratio)
    scaler = build_grad_scaler(cfg.precision, dist.device)
    create_optimizer_state(model, optimizer)  # as traced: fp16's scaler may skip the first steps, which make none
    micro = [[0] * cfg.train.micro_batch_size for _ in range(accum)]

    def step() -> None:  # the batches are made inside, as in the traced step
        batches, count_tokens = shape_only_batches(cfg, micro, dist.device)
        train_step(model, optimizer, scaler, batches, cfg, dist, count_tokens,
                   sync_each=built.sync_grads_each_micro_step)

    step()
    if state_only:
        from shardtune.train.optim import optimizer_state_bytes

        return optimizer_state_bytes(optimizer)
    if dist.device.type == "cpu" and optimizer_only:
        peaks, update = [], optimizer.step

        def measured(*args, **kwargs):
            done = []
            peaks.append(allocator_peak(lambda: done.append(update(*args, **kwargs)),
                                        held_bytes(model, optimizer, dist.device)))
            return done[0]

        optimizer.step = measured  # train_step calls optimizer.step()
        step()
        return max(peaks)
    if dist.device.type == "cpu":
        return allocator_peak(step, held_bytes(model, optimizer, dist.device))
    # untracked: under a dispatch mode (MemTracker's) autograd sums a tensor's gradients out of place
    torch.cuda.reset_peak_memory_stats(dist.device)  # torch.cuda.max_memory_* then cover this step only
    step()
    return torch.cuda.max_memory_allocated(dist.device)


def held_bytes(model, optimizer, device) -> int:
    """Bytes of the storages `model` and `optimizer` hold on `device` (parameters, buffers,
    gradients, optimizer state; each storage once)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker.get_tracker_snapshot().get(torch.device(device), {}).get("Total", 0)


def allocator_peak(run, held: int) -> int:
    """`held` plus the highest running total of the CPU allocator's allocations less its frees
    while `run()` runs (profiler memory events in time order; a free of a block allocated before
    `run` reports nothing, so a step that frees what it did not allocate is counted high).

    One free the profiler cannot see is taken from the collective instead: a copy gloo makes
    inside a blocking collective (the reduce-scatter's clone) is owned by the work, and the
    work's last owner is, by timing, the caller or gloo's worker thread, where the profiler is
    off; a block made inside a `c10d::` op and never seen freed is freed when that op returns
    (what the caller waited for). Without this the measure grows with the machine's load."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    changes, live = [], {}  # (time, bytes); ptr -> (bytes, end of the collective it was made in)

    def unseen_free(ptr: int) -> None:
        size, collective_end = live.pop(ptr)
        if collective_end is not None:
            changes.append((collective_end, -size))

    def walk(event, collective_end) -> None:
        if event.name.startswith("c10d::"):
            collective_end = event.end_time_ns
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
            changes.append((event.start_time_ns, size))
            if size > 0:
                if ptr in live:  # the address is handed out again: its block was freed unseen
                    unseen_free(ptr)
                live[ptr] = (size, collective_end)
            else:
                live.pop(ptr, None)
        for child in event.children:
            walk(child, collective_end)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    for ptr in list(live):
        unseen_free(ptr)
    now = peak = 0
    for _, size in sorted(changes):
        now += size
        peak = max(peak, now)
    return held + peak
