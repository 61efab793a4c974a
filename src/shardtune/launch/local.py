"""`--nproc N`: start N local ranks of the same command with torch's elastic launcher.

Joining the process group (here, under `torchrun` or under `srun`) is `shardtune.distributed.process_group`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from shardtune.distributed.process_group import LAUNCHER_ENV
from shardtune.errors import EXIT_CRASH, EXIT_PREEMPTED, EXIT_USAGE
from shardtune.rank.lifecycle import COMPLETED_ENV, ERROR_NOTE, PEER_NOTE
from shardtune.rank.preemption import say_from_handler, sigint_ignored

# How the launcher's line about failed ranks ends (a sweep's trial looks past it for the ranks' own error).
SUMMARY_END = "; see the ranks' output above"


def launch_local(nproc: int, worker_argv: list[str],
                 interrupt_note: str = "Ctrl-C: stopping the ranks; Ctrl-C again stops them at once") -> int:
    """Run `python -m shardtune <worker_argv>` as `nproc` local ranks with torch's elastic agent.
    Returns the ranks' exit code, or 128 + N when this process got signal N and stopped them.

    SIGTERM (and SIGHUP, SIGQUIT) go to the ranks through the agent, which waits for them. So does
    the first Ctrl-C (SIGINT), after `interrupt_note`; a second Ctrl-C is passed on again, and
    the ranks stop at once; started with SIGINT ignored, it ignores it (rank/preemption.py). The
    workers die with this process (`die_with_launcher`)."""
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
    quiet_agent_loggers()
    # for the ranks only: left in this process, a later run in it (a notebook calling main() again)
    # took itself for a rank of `--nproc N` (said nothing on Ctrl-C) and kept this N's thread count
    before = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", LAUNCHER_ENV, COMPLETED_ENV)}
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            say_from_handler(interrupt_note)
            raise SignalException("Ctrl-C", sigval=signal.SIGINT)  # the agent passes SIGINT on to the ranks
        say_from_handler("Ctrl-C again: stopping the ranks now, without waiting for a checkpoint")
        for pid in _child_pids():
            try:
                os.killpg(pid, signal.SIGINT)  # each worker leads its own session (the agent's choice)
            except OSError:
                pass

    # started with Ctrl-C ignored (nohup, `&`): the launcher ignores it, like the ranks that inherit it
    previous = signal.getsignal(signal.SIGINT) if sigint_ignored() else signal.signal(signal.SIGINT, on_sigint)
    completed = Path(tempfile.mkdtemp(prefix="shardtune-completed-"))
    os.environ[COMPLETED_ENV] = str(completed)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "shardtune", *worker_argv)
    except SignalException as exc:  # the ranks were stopped by the agent and have exited
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        code, line = failed_launch({rank: f.exitcode for rank, f in exc.failures.items()}, read_completed(completed),
                                   read_notes(completed))
        if line:
            print(line, file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGINT, previous)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(completed, ignore_errors=True)
    return 0


def usable_cores() -> int:
    """The cores this process may run on: a Slurm job's (its cpuset), taskset's, else the machine's.
    os.cpu_count() is the machine's: in a job of 16 of 128 cores, `--nproc 4` ran 32 threads a rank."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def quiet_agent_loggers() -> None:
    """The workers print their own errors, and this launcher says how they stopped; the agent's
    retelling ("Received 2 death signal, shutting down workers" on a Ctrl-C) would bury the one line
    that matters. Each of its modules' loggers has a level of its own (torch's `get_logger`), which
    a level on their parent does not override: every one is set, and the parent for those to come."""
    import logging

    for name in ["torch.distributed.elastic", *logging.Logger.manager.loggerDict]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def failed_launch(codes: dict[int, int], completed: dict[int, int],
                  notes: dict[str, dict[int, str]] | None = None) -> tuple[int, str]:
    """The launch's exit code and its line, given the failed ranks' exit codes (negative: the
    signal), the codes of the ranks that marked the run completed and the notes failed ranks left
    (`leave_note`: a bad-input line, or that a peer left first). A rank marks it only after
    the closing barrier, so one mark means every rank had finished its work: a rank that died
    after that (or was killed by the agent because another did) failed nothing."""
    notes = notes or {}
    if completed:
        code = max(completed.values())  # 75 (preempted, with a checkpoint) over 0
        deaths = {rank: c for rank, c in codes.items() if c != completed.get(rank, code)}
        if not deaths:  # every rank ended as it meant to (e.g. 75 after a preemption checkpoint)
            return code, ""
        listed = ", ".join(f"rank {rank} ({_exit_words(c)})" for rank, c in sorted(deaths.items()))
        return code, (f"warning: {listed} ended after the run had completed (during shutdown); "
                      "the run's results are complete")
    values = set(codes.values())
    if EXIT_USAGE in values:
        errors = notes.get(ERROR_NOTE, {})
        if codes.get(0) == EXIT_USAGE or not errors:  # rank 0 printed the line (it speaks for the job)
            return EXIT_USAGE, ""
        return EXIT_USAGE, f"error: {errors[min(errors)]}"  # only a rank other than 0 had it: its line, once
    if values == {EXIT_PREEMPTED}:
        return EXIT_PREEMPTED, ""
    # the ranks that failed, not those that stopped because one did: the agent's SIGTERM, a collective
    # whose peer was gone
    peers = notes.get(PEER_NOTE, {})
    first = {rank: c for rank, c in codes.items() if rank not in peers and c != -signal.SIGTERM} or codes
    listed = ", ".join(f"rank {rank} ({_exit_words(c)})" for rank, c in sorted(first.items()))
    others = len(codes) - len(first)
    return EXIT_CRASH, (f"error: {listed} failed" + (f"; {others} other rank(s) stopped with it" if others else "")
                        + SUMMARY_END)


def read_notes(folder: Path) -> dict[str, dict[int, str]]:
    """What failed ranks left for the launcher (`leave_note`), by kind and rank."""
    notes: dict[str, dict[int, str]] = {ERROR_NOTE: {}, PEER_NOTE: {}}
    for kind, found in notes.items():
        for path in folder.glob(f"{kind}-rank-*"):
            try:
                found[int(path.name.removeprefix(f"{kind}-rank-"))] = path.read_text().strip()
            except (OSError, ValueError):
                continue
    notes[ERROR_NOTE] = {rank: line for rank, line in notes[ERROR_NOTE].items() if line}
    return notes


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def read_completed(folder: Path) -> dict[int, int]:
    found = {}
    for path in folder.glob("rank-*"):
        try:
            found[int(path.name.removeprefix("rank-"))] = int(path.read_text())
        except (OSError, ValueError):
            continue  # being written as the rank was killed: not a mark
    return found


def _child_pids() -> list[int]:
    pids = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


