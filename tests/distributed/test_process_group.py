"""Joining the process group: a process that takes itself for a rank of a job (RANK and WORLD_SIZE
left in its shell by a job) and waits for peers that never come says so after a while, once,
naming the rank, the address and what to unset; torch's own wait lasts 30 minutes, silently."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

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
