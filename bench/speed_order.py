"""Issue 33, item 5: the memory savers' measured speed order against the order `shardtune plan`
predicts for them.

    python bench/speed_order.py                    # CPU: vs_hf_trainer's cpu-vocab2048 shape, 1 rank, fp32
    python bench/speed_order.py --gpu --steps 6    # the Llama ~1B shape (vs_hf_trainer's gpu setup), bf16
    python bench/speed_order.py --rehearse         # the --gpu code path, tiny, on CPU

Each technique (activation checkpointing none / selective / every 2nd block / full, activation
offload) runs `shardtune train` for --steps steps, --rounds times interleaved (each round runs every
technique once, so a drift in the machine's load reaches all of them); measured s/step is the
median over rounds: on a GPU of a run's step times after its first; on CPU of its CPU seconds per
step on one thread, a run of --skip steps subtracted (a loaded machine's wall clock follows the
other processes, not the technique). Predicted s/step is the planner's own:
`cost.step_time` over a traced step of that technique (plan/trace.trace_step), for this machine:
on a GPU its `hardware.GPUS` entry; on CPU a card with this CPU's measured matmul FLOP/s and copy
bandwidth (only the order counts, not the scale). A pair the planner orders one way by more than
--tie and the measurement the other way by more than --tie is a disagreement; exit 1 if any.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_hf_trainer as V  # noqa: E402

import _common as C  # noqa: E402

TECHNIQUES = {"none": ["activation_checkpointing=none"], "selective": ["activation_checkpointing=selective"],
              "every_n (n=2)": ["activation_checkpointing=every_n", "activation_checkpointing_every=2"],
              "full": ["activation_checkpointing=full"],
              "offload": ["activation_checkpointing=none", "activation_offload=true"]}


def overrides(setup: dict, out: Path, extra: list[str]) -> list[str]:
    assets = C.quickstart_assets()
    return V.shardtune_overrides(setup, assets["tokenizer"], str(Path(assets["train"]).parent), out, 1,
                                 "full_shard") + ["save_final=false", "on_nan=skip", *extra]  # a NaN step is timed too


def train(setup: dict, out: Path, name: str, extra: list[str], env: dict) -> float:
    """One `shardtune train` run; its CPU seconds (user + system)."""
    cmd = [C.PYTHON, "-m", "shardtune", "train", *overrides(setup, out, extra), "--overwrite"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=C.BENCH_DIR.parent)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{name}: {C.last_error_line(proc)}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def measure(setup: dict, work: Path, name: str, extra: list[str], skip: int, clock: str) -> float:
    """s/step of `name`. wall: the median step time of one run, its first `skip` steps left out.
    cpu (a loaded CPU, whose wall clock follows the other processes): one thread, the CPU seconds
    of a run of --steps steps less those of a run of `skip` steps, per step (start-up cancels)."""
    out = work / name.split()[0]
    if clock == "cpu":
        env = {**C.torchrun_env(1), "OMP_NUM_THREADS": "1"}
        short = train({**setup, "steps": skip}, out, name, extra, env)
        return (train(setup, out, name, extra, env) - short) / (setup["steps"] - skip)
    train(setup, out, name, extra, C.torchrun_env(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["step_time_s"] for r in rows if "step_time_s" in r and "loss" in r][skip:])


def this_cpu():
    """A `hardware.GPU` describing this CPU for the planner's speed model: fp32 matmul FLOP/s and
    copy bandwidth measured here, on one thread, in CPU seconds (as the runs are measured)."""
    import torch

    from shardtune.hardware import GPU

    torch.set_num_threads(1)  # as the measured runs (--clock cpu)
    a = torch.randn(1024, 1024)
    a @ a
    t = time.process_time()
    for _ in range(8):
        a @ a
    flops = 8 * 2 * 1024 ** 3 / (time.process_time() - t)
    big = torch.empty(64 * 2 ** 20 // 4)
    other = torch.empty_like(big)
    t = time.process_time()
    for _ in range(8):
        other.copy_(big)
    gbs = 8 * 2 * big.nbytes / (time.process_time() - t) / 1e9
    tf = flops / 1e12
    return GPU("this CPU", "", 1 << 30, (tf, tf, tf, 0.0), gbs, gbs, gbs, 1 << 20, "measured here")


def predict(setup: dict, work: Path, extra: list[str], gpu) -> float:
    """The planner's s/step for this technique on `gpu` (one rank)."""
    from shardtune.config.load import check_world, load_config
    from shardtune.plan.cost import Candidate, Target, step_time
    from shardtune.plan.fit import resolve_hf_config
    from shardtune.plan.trace import trace_step

    cfg = load_config(None, overrides(setup, work / "predict", extra))
    hf_config, _ = resolve_hf_config(cfg)
    on_gpu = gpu.name != "this CPU"
    trace = trace_step(cfg, hf_config, 1, 1, target="cuda" if on_gpu else "cpu")
    cand = Candidate(cfg.fsdp.sharding, cfg.precision, cfg.train.micro_batch_size, cfg.activation_checkpointing,
                     cfg.activation_checkpointing_every, cfg.activation_offload, cfg.fsdp.reduce_dtype,
                     cfg.train.optimizer_state, cfg.fsdp.cpu_offload)
    return step_time(trace, hf_config, cand, cfg, Target(1, 1, gpu.memory_bytes, gpu), check_world(cfg, 1))["total"]


def disagreements(predicted: dict, measured: dict, tie: float) -> list[str]:
    out = []
    names = list(predicted)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            p, m = predicted[a] / predicted[b], measured[a] / measured[b]
            if (p > 1 + tie and m < 1 - tie) or (p < 1 - tie and m > 1 + tie):
                out.append(f"{a} vs {b}: predicted {p:.2f}x, measured {m:.2f}x")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="the Llama ~1B setup on the GPU (needs CUDA)")
    p.add_argument("--rehearse", action="store_true", help="the --gpu code path, tiny, on CPU")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip", type=int, default=1, help="first steps of a run left out")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the setup's "
                   "micro-batch on CPU, one micro-step; the setup's on a GPU)")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None, help="what s/step counts (default: cpu "
                   "seconds on CPU, wall on a GPU)")
    p.add_argument("--tie", type=float, default=0.05, help="ratios within this share of 1 are a tie (noise)")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more shardtune overrides")
    a = p.parse_args()
    if C.args_only():
        return 0
    name = "gpu" if a.gpu or a.rehearse else "cpu-vocab2048"
    setup = V.resolve_setup(name, a.steps, a.global_batch, a.rehearse)
    if not a.gpu and a.global_batch is None:
        setup["global"] = setup["micro"]
    clock = a.clock or ("wall" if a.gpu else "cpu")
    work = a.work or C.default_workdir() / "speed_order"
    print(C.machine_line())
    if a.gpu and not a.rehearse:  # a rehearsal runs the GPU setup's code path on this CPU
        import torch

        from shardtune.hardware import gpu_by_device_name

        gpu = gpu_by_device_name(torch.cuda.get_device_name())
        if gpu is None:
            raise SystemExit(f"{torch.cuda.get_device_name()} is not in hardware.GPUS: no prediction to compare")
    else:
        gpu = this_cpu()
    predicted = {t: predict(setup, work, [*x, *a.overrides], gpu) for t, x in TECHNIQUES.items()}
    runs: dict[str, list[float]] = {t: [] for t in TECHNIQUES}
    for _ in range(a.rounds):
        for t, x in TECHNIQUES.items():
            runs[t].append(measure(setup, work, t, [*x, *a.overrides], a.skip, clock))
    measured = {t: statistics.median(v) for t, v in runs.items()}
    rows = [[t, f"{predicted[t]:.3f}", f"{measured[t]:.3f}", " ".join(f"{v:.3f}" for v in runs[t])]
            for t in TECHNIQUES]
    print(f"{name} setup, micro-batch {setup['micro']}, global {setup['global']}, {a.steps} steps x {a.rounds} "
          f"rounds, {clock} seconds per step, {gpu.name} "
          f"({gpu.peak_flops('fp32') / 1e12:.2f} TFLOP/s fp32, {gpu.hbm_gbs:.0f} GB/s)")
    print(C.markdown_table(["technique", "predicted s/step", "measured s/step (median)", "rounds"], rows))
    print("predicted order:", " < ".join(sorted(predicted, key=predicted.get)))
    print("measured order: ", " < ".join(sorted(measured, key=measured.get)))
    bad = disagreements(predicted, measured, a.tie)
    print("disagreements beyond the tie:", "; ".join(bad) if bad else "none")
    if a.rehearse:  # a tiny model's wall times say nothing about the order: the code path is what ran
        print("(a rehearsal: the verdict does not count)")
        return 0
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
