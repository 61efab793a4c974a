"""Joining the process group: a process that takes itself for a rank of a job (RANK and WORLD_SIZE
left in its shell by a job) and waits for peers that never come says so after a while, once,
naming the rank, the address and what to unset; torch's own wait lasts 30 minutes, silently."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, child_env

WAITS = """
import shardtune.distributed.process_group as pg
pg.WAIT_NOTICE_S = 1.0
pg.init_distributed("cpu")
"""


def test_a_rank_whose_peers_never_come_says_so_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-c", WAITS], stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stderr.readline()  # the notice, or nothing once the process ends
        assert line.startswith("rank 0 of 2 (RANK and WORLD_SIZE from the environment) is waiting for the other "
                               f"ranks at 127.0.0.1:{port}"), line
        assert "unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT" in line and proc.poll() is None
    finally:
        proc.kill()
        proc.communicate()


def test_a_quick_join_says_nothing(capfd):
    from shardtune.distributed.process_group import waiting_notice

    with waiting_notice(0.2):
        pass
    time.sleep(0.4)
    assert "waiting" not in capfd.readouterr().err
    with waiting_notice(0.1):  # a slow one: once, however long it goes on
        time.sleep(0.5)
    assert capfd.readouterr().err.count("is waiting for the other ranks") == 1


# ----------------------------------------------------------------------------- Slurm's variables

TORCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def expand_hostlist(text: str) -> list[str]:
    """Reference: `scontrol show hostnames` from Slurm's documented grammar. Entries split at commas
    outside brackets; a bracket holds comma-separated N or LO-HI, each number as wide as LO is
    written (zero padding kept); several brackets in one entry multiply, the first slowest."""
    entries, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    hosts = []
    for entry in entries:
        parts = []  # per piece of the entry: its choices
        for literal, bracket in re.findall(r"([^\[\]]+)|\[([^\]]*)\]", entry):
            if literal:
                parts.append([literal])
            else:
                choices = []
                for item in bracket.split(","):
                    lo, _, hi = item.partition("-")
                    choices += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
                parts.append(choices)
        hosts += ["".join(p) for p in itertools.product(*parts)]
    return hosts


def _range(draw) -> str:
    width = draw(st.integers(1, 3))
    lo = draw(st.integers(0, 10 ** width - 1))
    hi = draw(st.integers(lo, lo + 12)) if draw(st.booleans()) else None
    return str(lo).zfill(width) + (f"-{str(hi).zfill(width)}" if hi is not None else "")


@st.composite
def hostlists(draw) -> str:
    literal = st.text("abnodegpu0123456789-._", min_size=1, max_size=6)
    entries = []
    for _ in range(draw(st.integers(1, 3))):
        pieces = [draw(literal)]
        for _ in range(draw(st.integers(0, 3))):
            pieces.append("[" + ",".join(_range(draw) for _ in range(draw(st.integers(1, 3)))) + "]")
            if draw(st.booleans()):
                pieces.append(draw(literal))
        entries.append("".join(pieces))
    return ",".join(entries)


@given(hostlists())
@settings(max_examples=300, deadline=None)
def test_first_host_is_scontrols_first_host(nodelist):
    """The master address of a task of srun alone, where scontrol cannot run: it was the list up to
    its first comma, "node[01-03" for node[01-03,07]. Any host list's first host, as scontrol gives it."""
    from shardtune.distributed.process_group import first_host

    assert first_host(nodelist) == expand_hostlist(nodelist)[0]


def test_the_reference_expander_follows_scontrol():
    assert expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_hostlist("a[1-2]-ib,b3") == ["a1-ib", "a2-ib", "b3"]
    assert expand_hostlist("r[1-2]n[09-10]") == ["r1n09", "r1n10", "r2n09", "r2n10"]


def _slurm_task(monkeypatch, **slurm):
    """A task of srun alone: Slurm's variables, no scontrol, in a private copy of the environment."""
    from shardtune.distributed.process_group import check_agent_env

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in TORCH_KEYS and not k.startswith("SLURM_")})
    monkeypatch.setenv("PATH", "/nonexistent")
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    check_agent_env()
    return {k: os.environ[k] for k in TORCH_KEYS}


@pytest.mark.parametrize("slurm, local_world, master", [
    # srun -N2 -n8 (no --ntasks-per-node): local rank 3 was refused as past a node of 1 task
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
      "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[01-03,07]"}, "4", "node01"),
    # srun -n5 -N2 puts 3 then 2: the 2nd node took the 1st node's 3
    ({"SLURM_STEP_NUM_TASKS": "5", "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
      "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_NTASKS_PER_NODE": "3", "SLURM_JOB_NODELIST": "a[1-2]-ib,b3"}, "2",
     "a1-ib"),
    # a step on the allocation's later nodes: rank 0 runs on the step's first node, not the job's
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
      "SLURM_TASKS_PER_NODE": "2,1(x2)", "SLURM_STEP_NODELIST": "gpu[12-14]", "SLURM_JOB_NODELIST": "gpu[10-14]"},
     "1", "gpu12"),
])
def test_srun_alone_reads_this_nodes_tasks_and_the_first_host(monkeypatch, slurm, local_world, master):
    env = _slurm_task(monkeypatch, SLURM_JOB_ID="1234", **slurm)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (slurm["SLURM_PROCID"], slurm["SLURM_STEP_NUM_TASKS"],
                                                                   slurm["SLURM_LOCALID"])
    assert (env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == (local_world, master)


@pytest.mark.parametrize("slurm, needle", [
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2"}, "SLURM_STEP_TASKS_PER_NODE='4(x2'"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4,4", "SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
])
def test_bad_tasks_per_node_is_one_line(monkeypatch, slurm, needle):
    from shardtune.errors import RankError

    with pytest.raises(RankError, match=needle.replace("(", r"\(")):
        _slurm_task(monkeypatch, SLURM_STEP_NUM_TASKS="8", SLURM_PROCID="0", **slurm)


def test_jobs_get_ports_of_their_own():
    """Two jobs sharing their first node met on one port: the script's fixed 29500, or srun alone's
    29500 + id % 1000 for ids 1000 apart. Jobs running at once (ids close together) get their own."""
    from shardtune.distributed.process_group import slurm_port

    ports = [slurm_port(job) for job in range(123_000, 133_000)]
    assert len(set(ports)) == len(ports) and all(1024 < p < 32768 for p in ports)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_steps_of_jobs_get_ports_of_their_own(job, step):
    """Two `srun` steps of one job at once (`srun ... &` twice in a batch script) met on the job's one
    port: the second's ranks joined the first's store, or died on a port in use. Steps 0-7 of jobs
    up to 1354 ids apart now never share one; any job and step id (the batch and interactive
    steps' are near 2**32) gives a port below Linux's ephemeral ones."""
    from shardtune.distributed.process_group import slurm_port

    assert 1024 < slurm_port(job, step) < 32768
    near = [slurm_port(job + j, s) for j in range(1355) for s in range(8)]
    assert len(set(near)) == len(near)


def test_srun_alone_takes_its_steps_port(monkeypatch):
    from shardtune.distributed.process_group import slurm_port

    task = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "9"}
    ports = [_slurm_task(monkeypatch, **task, SLURM_STEP_ID=step)["MASTER_PORT"] for step in ("0", "1")]
    assert ports == [str(slurm_port(9, 0)), str(slurm_port(9, 1))] and ports[0] != ports[1]


@pytest.mark.parametrize("visible, local_rank, expected", [(4, 3, 3), (1, 3, 0), (2, 3, None)])
def test_a_rank_takes_the_gpu_it_can_see(monkeypatch, visible, local_rank, expected):
    """srun --gpus-per-task=1 shows each task its one GPU as cuda:0: local rank 3 asked for cuda:3
    and died in CUDA ("invalid device ordinal"). Fewer GPUs than that, but more than one: one line."""
    import torch

    from shardtune.distributed.process_group import resolve_device
    from shardtune.errors import RankError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if expected is None:
        with pytest.raises(RankError, match="local rank 3 has no GPU"):
            resolve_device("auto")
    else:
        assert resolve_device("auto") == torch.device("cuda", expected)


@pytest.mark.parametrize("slurm", [
    # `srun --pty bash` (or salloc): a step's one task
    {"SLURM_JOB_NAME": "interactive", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"},
    # the batch script of `sbatch --ntasks=4`: the job's count, SLURM_PROCID=0, and no step of its own
    {"SLURM_JOB_NAME": "job.sbatch", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4", "SLURM_NPROCS": "4"},
], ids=["interactive-shell", "batch-script"])
def test_a_slurm_shell_that_is_no_task_of_a_step_is_a_lone_process(monkeypatch, capfd, tmp_path, slurm):
    """`srun --pty bash` (or salloc) gives the shell SLURM_PROCID=0 as a step's one task: `train --nproc 2`
    there was refused ("--nproc conflicts with the ranks torchrun/srun started"), `eval --nproc 2`
    ran in one process. The batch script of `sbatch --ntasks=4` (SLURM_NTASKS=4, SLURM_PROCID=0) took
    itself for rank 0 of 4: `train` waited for peers that never came, `train --nproc 4` was refused.
    Both are lone processes, as in any shell: --nproc N starts N ranks here, none runs alone."""
    from shardtune.cli.main import main
    from shardtune.distributed import process_group
    from shardtune.errors import UserError

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in TORCH_KEYS and not k.startswith("SLURM_")})
    for name, value in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "77",
                        "SLURM_JOB_NODELIST": "nid001096", **slurm}.items():
        monkeypatch.setenv(name, value)
    assert not process_group.launched_by_agent()

    def reached(nproc, device):
        raise UserError(f"reached the launch of {nproc} ranks")
    monkeypatch.setattr(process_group, "check_nproc", reached)
    assert main(["train", "--nproc", "4", "device=cpu", f"output_dir={tmp_path / 'out'}"]) == 2
    assert "reached the launch of 4 ranks" in capfd.readouterr().err
    # a task of a step of two (srun sets the step's count in each task): a rank, of the step's world
    # (`srun --preserve-env` leaves SLURM_NTASKS at the job's 4)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")
    assert process_group.launched_by_agent() and process_group.agent_world() == (2, 2)


@pytest.mark.parametrize("command", [["train", "device=cpu"], ["eval", "some-model", "--data", "x.txt"]])
def test_nproc_other_than_the_agents_ranks_is_refused_by_every_command(monkeypatch, capfd, tmp_path, command):
    """A rank of a 2-task srun step given --nproc 4: train refused it; eval ran on, ignoring it."""
    from shardtune.cli.main import main

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in TORCH_KEYS and not k.startswith("SLURM_")})
    for name, value in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "77",
                        "SLURM_JOB_NODELIST": "nid001096", "SLURM_STEP_NUM_TASKS": "2",
                        "SLURM_STEP_TASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--nproc", "4"]) == 2
    err = capfd.readouterr().err
    assert "--nproc 4 conflicts with the 2 rank(s) per node torchrun/srun started; drop --nproc" in err, err
    assert not list(tmp_path.iterdir())
