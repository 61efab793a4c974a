"""The process group: join the one torchrun / Slurm / our launcher started, or make one for a
lone process (a world of 1 is still a process group, so there is one code path)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from shardtune.errors import UserError

# Set by `launch_local` for its workers: the pid of the launcher that started them.
LAUNCHER_ENV = "SHARDTUNE_LAUNCHER_PID"


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


def env_int(name: str, default: int, least: int = 0) -> int:
    """A whole-number variable that torchrun or Slurm sets (a rank, a count): one line naming it
    where it holds something else, not a ValueError deep in torch."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise UserError(f"environment variable {name}={raw!r} is not a whole number"
                        f"{f' of at least {least}' if least else ''}; "
                        "unset it, or leave it to torchrun or srun, which set it")
    return value


def agent_world() -> tuple[int, int]:
    """(world size, ranks on this node) of a torchrun/elastic worker or an srun task, read before
    anything is planned or checked: srun without torchrun sets Slurm's variables only, so they
    are translated first (else such a task took itself for a world of one)."""
    _adopt_slurm_env()
    return env_int("WORLD_SIZE", 1, least=1), env_int("LOCAL_WORLD_SIZE", 1, least=1)


def _adopt_slurm_env() -> None:
    """srun without torchrun: translate Slurm's variables into torch.distributed's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    env = os.environ
    env["RANK"] = str(env_int("SLURM_PROCID", 0))
    env["WORLD_SIZE"] = str(env_int("SLURM_NTASKS", 1, least=1))
    env["LOCAL_RANK"] = str(env_int("SLURM_LOCALID", 0))
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        try:  # first host of the allocation
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=True).stdout.split()
            env["MASTER_ADDR"] = out[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            env["MASTER_ADDR"] = nodes.split(",")[0]
    env.setdefault("MASTER_PORT", str(29500 + env_int("SLURM_JOB_ID", 0) % 1000))


def resolve_device(requested: str) -> torch.device:  # noqa: F821
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or run on a GPU machine")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", env_int("LOCAL_RANK", 0))


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
    if launched_by_agent():  # what torch reads next, checked first
        env_int("RANK", 0), env_int("WORLD_SIZE", 1, least=1)
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
                local_world_size=env_int("LOCAL_WORLD_SIZE", world, least=1),
                device=device)
