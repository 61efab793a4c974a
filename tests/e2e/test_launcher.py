"""The launcher of `--nproc 2`, as a user runs it (the real CLI): one live run per output
folder, Ctrl-C that checkpoints and says so only when it is true, and ranks that die with their
launcher on `kill -9` (started with SIGINT ignored, it ignores Ctrl-C), a rank killed named in one
line. Five launches, ~15 s each on 2 cores. And the variables torchrun or srun set, as a rank reads
them: wrong ones are one line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_errors import (  # noqa: F401 - fixtures used by name
    _isolated,
    datasets_cache,
    fails,
    one_error_line,
    out,
    qs_assets,
    recipe,
    snapshot,
    subprocess_env,
)

from shardtune.checkpoint.folders import read_meta
from shardtune.checkpoint.rundir import LOCK_FILE, hold_run_dir, release_run_dir
from shardtune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USAGE

pytestmark = pytest.mark.multiproc



def launch(recipe: str, out: Path, datasets_cache, *extra: str, sigint=signal.SIG_DFL) -> subprocess.Popen:
    """`sigint`: the launcher's SIGINT disposition at its start, whatever pytest's is (SIG_IGN
    under `nohup` or `&`): SIG_DFL as from a terminal, or SIG_IGN. Every test stops the run itself:
    its steps are many (a tiny model takes ~30 a second) so that it cannot end before the test acts."""
    return subprocess.Popen([sys.executable, "-m", "shardtune", "train", recipe, "device=cpu", "train.max_steps=4000",
                             "eval.at_start=false", f"output_dir={out}", "--nproc", "2", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent,
                            env=subprocess_env(datasets_cache), preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


@contextlib.contextmanager
def launched(recipe: str, out: Path, datasets_cache, *extra: str, sigint=signal.SIG_DFL):
    """A 2-rank run in the background; killed on the way out, whatever the test saw."""
    proc = launch(recipe, out, datasets_cache, *extra, sigint=sigint)
    try:
        yield proc
    finally:
        proc.kill()


def ctrl_c(proc: subprocess.Popen, times: int = 1, gap: float = 0.05) -> str:
    """Ctrl-C `times` times, `gap` seconds apart; the launcher's output once it has exited.
    `proc.delivered`: how many reached it alive (send_signal skips a process that has exited: on a
    loaded machine the first Ctrl-C's checkpoint and exit can fit in the gap)."""
    proc.delivered = 0
    for _ in range(times):
        proc.delivered += proc.poll() is None
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
    return proc.communicate(timeout=120)[0]


def wait_for(condition, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def training(out: Path):
    metrics = out / "metrics.jsonl"
    return lambda: metrics.is_file() and '"loss"' in metrics.read_text()


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_nproc2_lock_then_ctrl_c_checkpoints(recipe, tmp_path, datasets_cache):
    """While a 2-rank run trains, a second run on its folder is refused naming the live run
    (not "pass resume=auto"); then Ctrl-C: the ranks save a checkpoint, exit 75, and the
    launcher names that checkpoint."""
    out = tmp_path / "run"
    with launched(recipe, out, datasets_cache) as proc:
        wait_for(training(out), 180, proc)
        second = subprocess.run([sys.executable, "-m", "shardtune", "train", recipe, "resume=auto", f"output_dir={out}",
                                 "--nproc", "2"], capture_output=True, text=True, timeout=120,
                                env=subprocess_env(datasets_cache))
        assert second.returncode == EXIT_USAGE, second.stderr
        line = one_error_line(second.stderr)
        assert "in use by a live run" in line and f"pid {proc.pid} on " in line and "resume=auto" not in line
        output = ctrl_c(proc)
    assert proc.returncode == EXIT_PREEMPTED, output
    step = int((out / "PREEMPTED").read_text())
    ckpt = out / "checkpoints" / f"step-{step:06d}"
    assert f"SIGINT: the ranks saved {ckpt} and stopped; exit 75" in output
    assert read_meta(ckpt)["world_size"] == 2
    assert not (out / LOCK_FILE).exists()


def test_nproc2_ctrl_c_twice_stops_at_once(recipe, tmp_path, datasets_cache):
    """Ctrl-C twice on a 2-rank run: both ranks stop at once; the exit code and the last line say
    what is on disk, whichever way the race went: 130 and the last good checkpoint when the second
    Ctrl-C came before the first one's checkpoint, else 75 and that checkpoint (a tiny model can
    save one in the 10 ms between, and exit: then the second never reaches it). No traceback, no
    rank left, the folder free."""
    out = tmp_path / "run"
    with launched(recipe, out, datasets_cache, "checkpoint.every_steps=2") as proc:
        wait_for(lambda: (out / "checkpoints" / "latest").is_file(), 180, proc)
        ranks = children(proc.pid)
        output = ctrl_c(proc, times=2, gap=0.01)
    if proc.delivered == 2:
        assert "Ctrl-C again: stopping the ranks now, without waiting for a checkpoint" in output
    last_line = output.splitlines()[-1]
    if (out / "PREEMPTED").exists():
        ckpt = out / "checkpoints" / f"step-{int((out / 'PREEMPTED').read_text()):06d}"
        assert proc.returncode == EXIT_PREEMPTED and f"SIGINT: the ranks saved {ckpt} and stopped" in last_line, output
        assert read_meta(ckpt)["world_size"] == 2
    else:
        assert proc.returncode == EXIT_INTERRUPTED, output
        last = (out / "checkpoints" / "latest").read_text().strip()
        assert f"the last good checkpoint is {out / 'checkpoints' / last}" in last_line, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert not any(alive(pid) for pid in ranks) and not (out / LOCK_FILE).exists()


def test_nproc2_ctrl_c_before_training_claims_no_checkpoint(recipe, tmp_path, datasets_cache):
    out = tmp_path / "run"
    with launched(recipe, out, datasets_cache) as proc:
        wait_for(lambda: len(children(proc.pid)) == 2, 60, proc)
        output = ctrl_c(proc)
    assert proc.returncode == EXIT_INTERRUPTED, output
    assert "SIGINT: the ranks stopped without writing a checkpoint; this run has no checkpoint; exit 130" in output
    assert "saved" not in output and not (out / "checkpoints").exists()


def test_nproc2_ignores_ctrl_c_when_started_so_and_ranks_die_with_their_launcher(recipe, tmp_path, datasets_cache):
    """Started under `nohup` or `&` (SIGINT ignored): Ctrl-C twice reaches neither the launcher
    nor the ranks, which train on. Then kill -9 of the launcher: both ranks are gone within
    seconds, and the folder is free for the next run (the lock went with the launcher)."""
    out = tmp_path / "run"
    proc = launch(recipe, out, datasets_cache, sigint=signal.SIG_IGN)
    try:
        wait_for(training(out), 180, proc)
        ranks = children(proc.pid)
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks)
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        steps = len((out / "metrics.jsonl").read_text().splitlines())
        wait_for(lambda: len((out / "metrics.jsonl").read_text().splitlines()) > steps + 1, 60, proc)
        assert all(alive(pid) for pid in ranks) and not (out / "PREEMPTED").exists()
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while any(alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in ranks), "ranks outlived their launcher"
    finally:
        proc.kill()
        output = proc.communicate()[0]
    assert "Ctrl-C" not in output and "SIGINT" not in output, output
    hold_run_dir(out)
    release_run_dir(out)


def test_nproc2_a_rank_killed_is_named_in_one_line(recipe, tmp_path, datasets_cache):
    """kill -9 of one rank while it trains (the OOM killer): the launcher stops within seconds and
    its one line names that rank and its signal; the rank whose collective failed with it prints no
    traceback of its own (gloo's "Connection closed by peer" buried the line); the folder is free."""
    out = tmp_path / "run"
    with launched(recipe, out, datasets_cache) as proc:
        wait_for(training(out), 180, proc)
        ranks = children(proc.pid)
        os.kill(ranks[-1], signal.SIGKILL)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: rank ") and "(signal SIGKILL) failed" in errors[0], output
    assert "Traceback" not in output and "Connection closed" not in output, output
    assert not any(alive(pid) for pid in ranks) and not (out / LOCK_FILE).exists()


JOB = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


@pytest.mark.parametrize("env, name", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x'"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),  # printed, though no rank 0 is known
    ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID='x'"),  # srun without torchrun
    # a job torch cannot join: a traceback from torch's env://, or a rank past the world waiting forever
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),  # a stray variable: printed, though not rank 0
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),  # else one rank trained, silently
    ({"RANK": "0", "WORLD_SIZE": "1"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", **JOB, "MASTER_PORT": "abc"}, "MASTER_PORT='abc'"),
    ({"RANK": "0", "WORLD_SIZE": "2", **JOB, "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"RANK": "3", "WORLD_SIZE": "2", **JOB}, "RANK=3 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", **JOB}, "LOCAL_WORLD_SIZE='4'"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", **JOB}, "LOCAL_RANK='2'"),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID='3'"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS_PER_NODE": "abc"}, "SLURM_NTASKS_PER_NODE='abc'"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "many"}, "SLURM_STEP_NUM_TASKS='many'"),
])
def test_launcher_variables_torch_cannot_join(capfd, monkeypatch, recipe, out, env, name):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()  # Slurm's become torch's: undone after
                                        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = snapshot(out)
    fails(capfd, ["train", recipe, f"output_dir={out}"], name, "torchrun or srun")
    assert snapshot(out) == before


def test_a_stray_rank_variable_keeps_the_error_line(capfd, monkeypatch, recipe):
    """A lone process speaks whatever RANK says (every command, not only those that read it)."""
    monkeypatch.setenv("RANK", "1")
    fails(capfd, ["plan", recipe, "train.lrr=1", "--gpus", "1", "--gpu-mem", "16GiB"], "train.lrr")
