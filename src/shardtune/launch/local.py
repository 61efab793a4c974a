"""`--nproc N`: start N local ranks of the same command with torch's elastic launcher.

Joining the process group (here, under `torchrun` or under `srun`) is `shardtune.distributed.process_group`.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid

from shardtune.distributed.process_group import LAUNCHER_ENV
from shardtune.errors import EXIT_PREEMPTED, EXIT_USAGE
from shardtune.launch.signals import sigint_ignored

PR_SET_PDEATHSIG = 1  # linux/prctl.h

def launch_local(nproc: int, worker_argv: list[str],
                 interrupt_note: str = "Ctrl-C: stopping the ranks; Ctrl-C again stops them at once") -> int:
    """Run `python -m shardtune <worker_argv>` as `nproc` local ranks with torch's elastic agent.
    Returns the ranks' exit code, or 128 + N when this process got signal N and stopped them.

    SIGTERM (and SIGHUP, SIGQUIT) go to the ranks through the agent, which waits for them. So does
    the first Ctrl-C (SIGINT), after `interrupt_note`; a second Ctrl-C is passed on again, and
    the ranks stop at once; started with SIGINT ignored, it ignores it (launch/signals.py). The
    workers die with this process (`die_with_launcher`)."""
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

    # started with Ctrl-C ignored (nohup, `&`): the launcher ignores it, like the ranks that inherit it
    previous = signal.getsignal(signal.SIGINT) if sigint_ignored() else signal.signal(signal.SIGINT, on_sigint)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "shardtune", *worker_argv)
    except SignalException as exc:  # the ranks were stopped by the agent and have exited
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if EXIT_USAGE in codes:
            return EXIT_USAGE
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


