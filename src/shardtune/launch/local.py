"""Processes: start N local workers, or join the group torchrun / Slurm already started.

One command covers every layout:
- plain `shardtune train ...`      -> world of 1 (still a process group, so one code path);
- `shardtune train ... --nproc N`  -> torch's elastic launcher starts N copies of the same command;
- under `torchrun` or `srun`       -> the environment names rank and world; we join.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass

from shardtune.errors import EXIT_USAGE, UserError

# Set by `launch_local` for its workers: the pid of the launcher that started them.
LAUNCHER_ENV = "SHARDTUNE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Dist:
    rank: int
    world_size: int
    local_world_size: int  # ranks on this node: hybrid_shard's default shard group
    device: torch.device  # noqa: F821

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_agent() -> bool:
    """True inside a torchrun/elastic worker or an srun task."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def _adopt_slurm_env() -> None:
    """srun without torchrun: translate Slurm's variables into torch.distributed's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    env = os.environ
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        try:  # first host of the allocation
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=True).stdout.split()
            env["MASTER_ADDR"] = out[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            env["MASTER_ADDR"] = nodes.split(",")[0]
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))


def resolve_device(requested: str) -> torch.device:  # noqa: F821
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or run on a GPU machine")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def check_nproc(nproc: int, requested_device: str) -> None:
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if requested_device == "cpu":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus:
        raise UserError(f"--nproc {nproc} asks for more ranks than the {gpus} CUDA GPU(s) present; "
                        f"use --nproc {gpus} or fewer (or device=cpu)")
    if requested_device == "cuda" and not gpus:
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or run on a GPU machine")


def init_distributed(requested_device: str) -> Dist:
    """Join (or create, for a lone process) the default process group."""
    import torch
    import torch.distributed as dist

    _adopt_slurm_env()
    device = resolve_device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched_by_agent():
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        else:  # a lone process: a private in-memory store, no ports
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    return Dist(rank=dist.get_rank(), world_size=world,
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
                device=device)


def launch_local(nproc: int, worker_argv: list[str],
                 interrupt_note: str = "Ctrl-C: stopping the ranks; Ctrl-C again stops them at once") -> int:
    """Run `python -m shardtune <worker_argv>` as `nproc` local ranks with torch's elastic agent.
    Returns the ranks' exit code, or 128 + N when this process got signal N and stopped them.

    SIGTERM (and SIGHUP, SIGQUIT) go to the ranks through the agent, which waits for them. So does
    the first Ctrl-C (SIGINT), after `interrupt_note`; a second Ctrl-C is passed on again, and
    the ranks stop at once. The workers die with this process (`die_with_launcher`)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Time for the ranks to checkpoint after SIGTERM. torch 2.11's LaunchConfig has no
    # shutdown_timeout: its agent gives the ranks a fixed 30 s before SIGKILL.
    grace = {"shutdown_timeout": 900} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                          max_restarts=0, monitor_interval=0.5, **grace,
                          signals_to_handle="SIGTERM,SIGHUP,SIGQUIT")  # SIGINT: `on_sigint` below
    # The workers print their own errors; the agent's retelling would bury the one line that matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            _say(interrupt_note)
            raise SignalException("Ctrl-C", sigval=signal.SIGINT)  # the agent passes SIGINT on to the ranks
        _say("Ctrl-C again: stopping the ranks now, without a checkpoint")
        for pid in _child_pids():
            try:
                os.killpg(pid, signal.SIGINT)  # each worker leads its own session (the agent's choice)
            except OSError:
                pass

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "shardtune", *worker_argv)
    except SignalException as exc:  # the ranks were stopped by the agent and have exited
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if EXIT_USAGE in codes:
            return EXIT_USAGE
        from shardtune.launch.signals import EXIT_PREEMPTED

        if codes == {EXIT_PREEMPTED}:
            return EXIT_PREEMPTED
        print(f"error: {len(exc.failures)} worker(s) failed (exit codes {sorted(codes)}); "
              f"see their output above", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def die_with_launcher() -> None:
    """In a worker of an elastic agent (ours or torchrun): be killed when the agent dies, so a
    `kill -9` of the launcher leaves no ranks training on (Linux's parent-death signal)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and int(launcher) != os.getppid():  # it died before the prctl took effect
        os._exit(1)


def _child_pids() -> list[int]:
    pids = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def _say(text: str) -> None:
    """A line on stderr from a signal handler (os.write: print may be in use when it runs)."""
    os.write(sys.stderr.fileno(), (text + "\n").encode())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank0_first(dist: Dist, fn):
    """Run `fn` on rank 0, then on the others (e.g. to fill a cache once). A UserError on
    rank 0 is re-raised on every rank instead of leaving the others waiting forever."""
    import torch.distributed as tdist

    result, error = None, None
    if dist.is_main:
        try:
            result = fn()
        except UserError as exc:
            error = str(exc)
    if dist.world_size > 1:
        box = [error]
        tdist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise UserError(error)
    return result if dist.is_main else fn()


def broadcast_value(dist: Dist, value):
    """Rank 0's `value` on every rank."""
    if dist.world_size == 1:
        return value
    import torch.distributed as tdist

    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(*values, device) -> list[float]:
    """The element-wise sum of `values` over all ranks, as floats (one all-reduce; a host sync)."""
    return all_sum_on_device(*values, device=device).tolist()


def all_sum_on_device(*values, device):
    """The element-wise sum of `values` over all ranks as one float64 tensor on `device`: the
    all-reduce is queued, nothing waits for it until the tensor is read."""
    import torch.distributed as dist

    t = stack_on_device(*values, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def stack_on_device(*values, device):
    """Numbers and 0-d tensors as one float64 tensor on `device`. Python numbers are filled in
    there: a copy from host memory could wait for the device's queue."""
    import torch

    return torch.stack([v.to(device, torch.float64) if isinstance(v, torch.Tensor)
                        else torch.full((), float(v), dtype=torch.float64, device=device) for v in values])
