"""What a run reports: metrics.jsonl (always, rank 0) and a progress bar (rank 0)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from shardtune.diskspace import tensor_bytes
from shardtune.hardware import GIB


class MetricsLog:
    """Appends one JSON object per line. Only the main rank writes."""

    def __init__(self, path: Path, enabled: bool):
        self.enabled = enabled
        self._file = open(path, "a", buffering=1) if enabled else None

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class StepClock:
    """When a step's work is done. On a GPU, a CUDA event queued behind the step: the host reads
    a step's numbers one step late, so its own clock would say when the next step was queued;
    once those numbers are read the event is complete and costs no wait. On a CPU every op is
    done when it returns, so the host's clock is the step's."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()  # elapsed_time refuses an event not yet reached; the step's numbers, read, may
        return start.elapsed_time(end) / 1000  # have been copied just before it (train.step.HostCopy)


class StepMeter:
    """Speed between two log lines: tokens/s (global and per device), step time, the share of
    it spent assembling batches, and MFU when the device's peak is known. Each step is timed from
    the StepClock mark taken before it asked for its batches to the one queued behind its work:
    what the loop does between steps (evaluation, checkpoints, profiler traces) is no step's time."""

    def __init__(self, world_size: int, flops: tuple[float, float], peak_flops: float | None, clock: StepClock):
        self.world_size, self.flops, self.peak_flops = world_size, flops, peak_flops  # flops: `flops_rates`
        self.clock = clock
        self._reset()

    def _reset(self) -> None:
        self._steps = self._tokens = self._pairs = self._virtual = 0
        self._data_s = self._step_s = 0.0

    def add(self, global_tokens: float, attention_pairs: float, data_seconds: float, began, done,
            virtual_tokens: float = 0) -> None:
        """A step that was read: its tokens and their (query, key) pairs (step.attention_pairs), the
        loop's wait for its batches, its StepClock marks; prompt tuning's virtual input tokens, which
        the model computes as it does the data's (MFU), but are none of the data (tokens/s)."""
        self._steps += 1
        self._tokens += global_tokens
        self._pairs += attention_pairs
        self._virtual += virtual_tokens
        self._data_s += data_seconds
        self._step_s += self.clock.seconds(began, done)

    def report(self) -> dict:
        elapsed = max(self._step_s, 1e-9)
        rate = self._tokens / elapsed
        out = {"tokens_per_s": rate, "tokens_per_s_per_device": rate / self.world_size,
               "step_time_s": elapsed / max(self._steps, 1), "data_wait_share": min(1.0, self._data_s / elapsed)}
        if self.peak_flops:
            per_token, per_pair = self.flops
            useful = (self._tokens + self._virtual) * per_token + self._pairs * per_pair
            out["mfu"] = useful / elapsed / (self.peak_flops * self.world_size)
        self._reset()
        return out


class Progress:
    """tqdm bar on the main rank; nothing elsewhere."""

    def __init__(self, total: int, initial: int, is_main: bool, bar: bool = True):
        self.is_main, self.bar = is_main, None
        if is_main and bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, disable=None)

    def update(self, steps: int, **fields) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in fields.items()}, refresh=False)
            self.bar.update(steps)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        elif self.is_main:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def state_bytes(model, optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards only)."""
    params = list(model.parameters())
    return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes([p.grad for p in params]),
            "optim_bytes": tensor_bytes([v for s in optimizer.state.values() for v in s.values()
                                         if hasattr(v, "dim") and v.dim() > 0])}


# ----------------------------------------------------------------------------- memory


def memory_stats(device) -> dict:
    """Peak memory since the last call: CUDA allocated/reserved, or process RSS on CPU (GiB)."""
    if device.type == "cuda":

        stats = {"mem_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                 "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    return {"mem_rss_peak_gib": peak_rss_bytes() / GIB}


def peak_rss_bytes() -> int:
    """This process's peak resident memory. getrusage's ru_maxrss is in KiB on Linux, in bytes on
    macOS (a Mac's CPU run recorded 1024x its peak)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class LiveMemory:
    """Peak bytes of live tensors on the run's device over the first `steps` steps
    (`log.live_memory`), counted by torch's MemTracker as storages are created and freed. It is
    what a memory planner predicts: CPU has no allocator statistics, and RSS also holds pages the
    C allocator keeps after tensors are freed. Tracked steps run slower (every op passes through
    Python: +35 % step time for a 3M-parameter GPT-2 on CPU), hence opt-in and only the first steps.
    They also hold a little more than untracked ones: under a dispatch mode autograd sums a
    tensor's gradients out of place (at a tied embedding, one vocab x hidden more)."""

    def __init__(self, model, optimizer, device, steps: int):
        self.device, self.remaining, self.peak = device, steps, None
        self._tracker = None
        if steps > 0:
            self._tracker = PeakOnlyTracker()
            self._tracker.track_external(model, optimizer)  # what exists before the first tracked step

    @contextlib.contextmanager
    def track(self):
        if self.remaining <= 0:
            yield
            return
        self.remaining -= 1
        with self._tracker:
            yield
        peak = self._tracker.get_tracker_snapshot("peak").get(self.device, {}).get("Total", 0)
        self.peak = max(self.peak or 0, peak)
        if self.remaining == 0:
            self._tracker = None  # stop holding weak references to every storage

    def read(self) -> dict:
        """The peak since the last read (only after a tracked step)."""
        peak, self.peak = self.peak, None
        return {} if peak is None else {"mem_live_peak_gib": peak / GIB}


class PeakOnlyTracker(MemTracker):
    """MemTracker keeping only the peak per device. Its per-module snapshots cost time that
    grows with modules x ops and refuse a second forward (gradient accumulation), so the
    module hooks do nothing; storages are still counted, which is all the total needs."""

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def _update_peak_stats(self, peak_state) -> None:
        for device, snap in self._curr_mem_snap.items():
            if snap["Total"] > self._peak_mem.get(device, 0):
                self._peak_mem[device] = snap["Total"]
                self._peak_mem_snap[device] = dict(snap)


class GPUSampler:
    """Background NVML sampling of GPU utilisation and memory; `read()` gives the means since
    the last read. Silently off where NVML is missing (CPU machines, no nvidia-ml-py). The card is
    asked for through torch.cuda, which maps `cuda:N` to NVML's index through CUDA_VISIBLE_DEVICES:
    NVML counts every card of the machine, so a rank given GPUs 2,3 (Slurm, a shared node) asked
    for index N sampled another job's card."""

    def __init__(self, device, interval: float = 0.5):
        import threading

        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = None
        if device.type != "cuda":
            return
        self._device, self._interval = device, interval
        try:
            self._sample()
        except Exception:  # no driver library / package: telemetry must never stop training
            return
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[float, float]:
        """(utilisation %, used memory GiB) of this rank's card now."""
        return float(torch.cuda.utilization(self._device)), torch.cuda.device_memory_used(self._device) / GIB

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                sample = self._sample()
            except Exception:
                return
            with self._lock:
                self._samples.append(sample)

    def read(self) -> dict:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return {}
        return {"gpu_util": sum(s[0] for s in samples) / len(samples),
                "gpu_mem_used_gib": max(s[1] for s in samples)}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


# ----------------------------------------------------------------------------- profiling


class StepProfiler:
    """torch.profiler over optimizer steps `first`..`last` (`log.profile_steps`, counted like the
    metrics' `step`), with the step before as warm-up (the profiler's own start-up distorts the
    first step it traces). Each rank writes into OUT/profile/ a Chrome trace (trace.json.gz;
    chrome://tracing or ui.perfetto.dev) and the table of operators by self time (ops.txt);
    with more ranks the names get `-rankN`. Shapes are not recorded: they multiply the trace's
    size and the profiler's overhead. Without `log.profile_steps` it does nothing."""

    ROWS = 40  # operators in the table

    def __init__(self, steps: list[int] | None, done: int, total: int, dist, out: Path):
        self._prof, self.dist, self.folder, self.done = None, dist, out / "profile", done
        if not steps:
            return
        first, last = max(steps[0], done + 1), min(steps[1], total)
        if first > last:  # the run (or its resumed part) does not reach the window
            if dist.is_main:
                print(f"warning: log.profile_steps={steps} lies outside steps {done + 1}..{total} of this run; "
                      "nothing profiled", flush=True)
            return
        self.window = (first, last)
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = min(1, first - done - 1)  # step numbers count from done + 1; the profiler's from 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dist.device.type == "cuda" else [])
        self._prof = profile(activities=activities, record_shapes=False, on_trace_ready=self._write,
                             schedule=schedule(wait=first - done - 1 - warmup, warmup=warmup,
                                               active=last - first + 1, repeat=1))
        self._prof.start()

    def step(self) -> None:
        """After each optimizer step: moves the profiler's schedule on."""
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        """At the end of training (also when it stopped early): writes what was traced."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()

    def _write(self, prof) -> None:
        suffix = f"-rank{self.dist.rank}" if self.dist.world_size > 1 else ""
        self.folder.mkdir(parents=True, exist_ok=True)
        trace, table = self.folder / f"trace{suffix}.json.gz", self.folder / f"ops{suffix}.txt"
        prof.export_chrome_trace(str(trace))
        sort = "self_device_time_total" if self.dist.device.type == "cuda" else "self_cpu_time_total"
        first, last = self.window
        table.write_text(f"optimizer steps {first}-{last} (the trace's ProfilerStep#N is step N + {self.done + 1}), "
                         f"operators by {sort}\n"
                         + prof.key_averages().table(sort_by=sort, row_limit=self.ROWS) + "\n")
        if self.dist.is_main:
            print(f"profile of steps {first}-{last}: {trace} (chrome://tracing or ui.perfetto.dev), {table}",
                  flush=True)
