"""The process group: join the one torchrun / Slurm / our launcher started, or make one for a
lone process (a world of 1 is still a process group, so there is one code path)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from dataclasses import dataclass

from shardtune.errors import RankError, UserError

# Set by `launch_local` for its workers: the pid of the launcher that started them.
LAUNCHER_ENV = "SHARDTUNE_LAUNCHER_PID"
# srun's count of its step's tasks, in each task: the world of srun alone. Not SLURM_NTASKS, which
# a batch script has too (the job's), and `srun --preserve-env` leaves at the job's count.
SLURM_STEP_TASKS = "SLURM_STEP_NUM_TASKS"
# A rank still waiting for its peers after this many seconds says so, once: a shell that kept
# RANK/WORLD_SIZE from a job made a lone `shardtune train` wait silently (torch's timeout: 30 min).
WAIT_NOTICE_S = 30.0


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
    """True inside a torchrun/elastic worker or a task of an srun step of several tasks. The shell
    of an interactive allocation (`srun --pty bash`, salloc on many sites) is a step's one task with
    SLURM_PROCID=0: a lone process, whose `--nproc N` was refused as a conflict with srun's ranks.
    So is the batch script of `sbatch --ntasks=4`: it has the job's SLURM_NTASKS=4 and SLURM_PROCID=0
    but is no task of a step (srun sets SLURM_STEP_NUM_TASKS for those only); read as rank 0 of 4,
    its `train` waited for 3 peers for good, and its `train --nproc 4` was refused."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or _srun_task()


def _srun_task() -> bool:
    """A task of an srun step of several tasks (torchrun's workers under srun are torchrun's ranks)."""
    return ("SLURM_PROCID" in os.environ and os.environ.get(SLURM_STEP_TASKS, "1").strip() != "1"
            and "TORCHELASTIC_RUN_ID" not in os.environ)


def is_main_process() -> bool:
    """Whether this process speaks for the job (its one error line, its notes): a lone process
    always, whatever a stray RANK says; a rank of torchrun/srun when it is rank 0, or when its
    rank is not a number (the line may be about that very variable)."""
    if not launched_by_agent():
        return True
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")).strip()
    return not rank.isdigit() or int(rank) == 0


def env_int(name: str, default: int, least: int = 0, most: int | None = None) -> int:
    """A whole-number variable that torchrun or Slurm sets (a rank, a count): one line naming it
    where it holds something else, not a ValueError deep in torch."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < least or most is not None and value > most:
        bounds = f" from {least} to {most}" if most is not None else f" of at least {least}" if least else ""
        raise RankError(f"environment variable {name}={raw!r} is not a whole number{bounds}; "
                        "unset it, or leave it to torchrun or srun, which set it")
    return value


# What torchrun's agent and srun set for a rank: a process that starts its own job (a sweep's
# trial) must not inherit them, or it takes itself for a rank of the job above and waits for peers.
AGENT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
              SLURM_STEP_TASKS, "SLURM_NTASKS_PER_NODE", LAUNCHER_ENV)


def own_job_env(env: dict) -> dict:
    """`env` for a process that starts a job of its own: without the launcher variables above."""
    return {k: v for k, v in env.items() if k not in AGENT_VARS}


def check_agent_env() -> None:
    """torch.distributed's variables (after Slurm's are translated), checked as one before
    anything is planned or built: each a value torch takes, and together a job it can join. Else
    torch raised a ValueError, or a rank numbered past the world waited for peers forever."""
    _adopt_slurm_env()
    given = [name for name in ("RANK", "WORLD_SIZE") if name in os.environ]
    if len(given) == 1:
        missing = "WORLD_SIZE" if given == ["RANK"] else "RANK"
        raise RankError(f"environment variable {given[0]} is set but {missing} is not; unset {given[0]} to run "
                        "alone, or start the ranks with --nproc N, torchrun or srun")
    if not given:
        return
    world = env_int("WORLD_SIZE", 1, least=1)
    rank = env_int("RANK", 0)
    if rank >= world:
        raise RankError(f"environment variable RANK={rank} is not below WORLD_SIZE={world} (ranks count from 0); "
                        "unset them, or leave them to torchrun or srun, which set them")
    local_world = env_int("LOCAL_WORLD_SIZE", world, least=1, most=world)
    env_int("LOCAL_RANK", 0, most=local_world - 1)
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise RankError("environment variable MASTER_ADDR is not set (RANK and WORLD_SIZE are); set MASTER_ADDR "
                        "and MASTER_PORT to rank 0's host and a free port, or leave them to torchrun or srun")
    if "MASTER_PORT" not in os.environ:
        raise RankError("environment variable MASTER_PORT is not set (RANK and WORLD_SIZE are); set it to a free "
                        "port of rank 0's host, or leave it to torchrun or srun")
    env_int("MASTER_PORT", 0, least=1, most=65535)


def agent_world() -> tuple[int, int]:
    """(world size, ranks on this node) of a torchrun/elastic worker or an srun task, read before
    anything is planned or checked: srun without torchrun sets Slurm's variables only, so they
    are translated first (else such a task took itself for a world of one)."""
    check_agent_env()
    return env_int("WORLD_SIZE", 1, least=1), env_int("LOCAL_WORLD_SIZE", 1, least=1)


def job_ranks(nproc: int | None, requested_device: str) -> tuple[int, int]:
    """(world size, ranks on this node) of a command given `--nproc` (None: not given): the agent's
    where torchrun/srun started this process (a different --nproc refused, by every command alike:
    eval ignored it), else --nproc's, checked against the GPUs present."""
    if launched_by_agent():
        world, local = agent_world()
        if nproc and nproc != local:
            raise UserError(f"--nproc {nproc} conflicts with the {local} rank(s) per node torchrun/srun started; "
                            "drop --nproc")
        return world, local
    nproc = 1 if nproc is None else nproc
    if nproc > 1:
        check_nproc(nproc, requested_device)
    return nproc, nproc


def _adopt_slurm_env() -> None:
    """srun without torchrun: translate Slurm's variables into torch.distributed's."""
    if "RANK" in os.environ or not launched_by_agent():
        return
    env = os.environ
    tasks = env_int(SLURM_STEP_TASKS, 1, least=1)
    env["RANK"] = str(env_int("SLURM_PROCID", 0, most=tasks - 1))
    env["WORLD_SIZE"] = str(tasks)
    env["LOCAL_RANK"] = str(env_int("SLURM_LOCALID", 0))
    env["LOCAL_WORLD_SIZE"] = str(_slurm_tasks_here())
    if "MASTER_ADDR" not in env:
        # rank 0 runs on the step's first node (a step may use part of the job's nodes)
        nodes = next((env[n] for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)),
                     "127.0.0.1")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=True).stdout.split()
            env["MASTER_ADDR"] = out[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            env["MASTER_ADDR"] = first_host(nodes)
    env.setdefault("MASTER_PORT", str(slurm_port(env_int("SLURM_JOB_ID", 0), env_int("SLURM_STEP_ID", 0))))


# A step's rendezvous port (srun alone, and the script of `shardtune slurm`): jobs that share a node
# must not meet on one fixed port, nor two steps of one job running at once (`srun ... &` twice);
# below Linux's ephemeral ports (32768-), where outgoing connections take theirs. Step s moves the
# job's port by s x STRIDE (mod SPAN), a stride near SPAN / golden ratio: steps 0-7 of jobs fewer
# than 1355 ids apart never share a port (a stride of 1 put step 1 of job j on step 0 of job j + 1).
SLURM_PORT_BASE, SLURM_PORT_SPAN, SLURM_PORT_STEP_STRIDE = 15000, 15000, 9271


def slurm_port(job_id: int, step_id: int = 0) -> int:
    return SLURM_PORT_BASE + (job_id + step_id * SLURM_PORT_STEP_STRIDE) % SLURM_PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, as `scontrol show hostnames` gives it first: the first
    entry (commas inside brackets do not end it) with each bracket group at its first value, its
    zero padding kept: "node[01-03,07]" -> "node01", "a[1-2]-ib,b3" -> "a1-ib"."""
    entry = re.match(r"(?:[^,\[]|\[[^\]]*\])*", nodelist.strip()).group(0)
    return re.sub(r"\[([^\],-]*)[^\]]*\]", r"\1", entry)


def slurm_tasks_per_node() -> tuple[str, list[int]] | None:
    """(the variable, its tasks on each node) of the step srun alone started ("4(x2),1": 4 on the
    first two nodes, 1 on the third); None where Slurm does not tell (torchrun's workers)."""
    if not _srun_task():
        return None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = os.environ.get(name, "").strip()
        if not text:
            continue
        if not re.fullmatch(r"[1-9]\d*(\(x[1-9]\d*\))?(,[1-9]\d*(\(x[1-9]\d*\))?)*", text):
            raise RankError(f"environment variable {name}={text!r} is not a number of tasks per node; "
                            "unset it, or leave it to torchrun or srun, which set it")
        return name, [int(n) for n, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", text) for _ in range(int(times or 1))]
    return None


def _slurm_tasks_here() -> int:
    """Tasks on this node: the step's count for node SLURM_NODEID. Else a task with SLURM_LOCALID 3
    of `srun -N2 -n8` took 1 for its node's count and was refused, and the 2nd node of `srun -n5 -N2`
    took the 1st node's 3."""
    told = slurm_tasks_per_node()
    if told is None:
        return 1
    name, counts = told
    node = env_int("SLURM_NODEID", 0)
    if len(counts) == 1 or node < len(counts):
        return counts[min(node, len(counts) - 1)]
    raise RankError(f"environment variable SLURM_NODEID={node} is past the {len(counts)} node(s) of "
                    f"{name}={os.environ[name].strip()!r}; unset them, or leave them to srun, which sets them")


def resolve_device(requested: str) -> torch.device:  # noqa: F821
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or run on a GPU machine")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank, visible = env_int("LOCAL_RANK", 0), torch.cuda.device_count()
    if local_rank < visible:
        return torch.device("cuda", local_rank)
    if visible == 1:  # srun --gpus-per-task=1 / --gpu-bind: each task sees its own GPU only, as cuda:0
        return torch.device("cuda", 0)
    raise RankError(f"local rank {local_rank} has no GPU of its own: this process sees {visible} CUDA GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); give each node's "
                    "tasks all its GPUs, or each task exactly one (srun --gpus-per-task=1)")


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

    check_agent_env()  # what torch reads next, checked first
    device = resolve_device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched_by_agent():
            with waiting_notice(WAIT_NOTICE_S):
                dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        else:  # a lone process: a private in-memory store, no ports
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    return Dist(rank=dist.get_rank(), world_size=world,
                local_world_size=env_int("LOCAL_WORLD_SIZE", world, least=1),
                device=device)


@contextlib.contextmanager
def waiting_notice(seconds: float):
    """One line to stderr if the block (joining the process group) is still waiting after
    `seconds`: which rank waits for whom, where those numbers came from, and what to unset for a
    process meant to run alone."""
    import sys
    import threading

    def say() -> None:
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        source = ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "Slurm" if "SLURM_PROCID" in os.environ
                  else "the environment")
        print(f"rank {rank} of {world} (RANK and WORLD_SIZE from {source}) is waiting for the other ranks at "
              f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({seconds:g}s so far); a process "
              "meant to run alone: stop it and unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT", file=sys.stderr,
              flush=True)

    timer = threading.Timer(seconds, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
