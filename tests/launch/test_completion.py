"""The launcher tells a rank that died after the run completed from one that failed: ranks mark
the run completed after its closing barrier (`mark_completed`), and `failed_launch` decides. A
rank that fails leaves a note (`leave_note`): its bad-input line, which rank 0 may not have, or
that a peer left first; the launcher then says the one line, naming the rank that failed."""

from __future__ import annotations

import signal

import pytest

from shardtune.cli.main import main
from shardtune.errors import EXIT_CRASH, EXIT_PREEMPTED, EXIT_USAGE, UserError
from shardtune.launch.local import failed_launch, quiet_agent_loggers, read_completed, read_notes
from shardtune.rank.lifecycle import COMPLETED_ENV, ERROR_NOTE, PEER_NOTE, mark_completed

ABRT, TERM, KILL = -int(signal.SIGABRT), -int(signal.SIGTERM), -int(signal.SIGKILL)
LINE = "data.path row 7 cannot be tokenized; fix row 7"


@pytest.mark.parametrize("codes, completed, code, words", [
    # the case: rank 1 aborted at interpreter exit, the agent killed rank 0; both had marked
    ({0: TERM, 1: ABRT}, {0: 0, 1: 0}, 0, ["warning:", "rank 0 (signal SIGTERM)", "rank 1 (signal SIGABRT)",
                                          "after the run had completed"]),
    # rank 0 was killed before writing its mark: rank 1's mark says both passed the barrier
    ({0: TERM, 1: ABRT}, {1: 0}, 0, ["warning:", "after the run had completed"]),
    # a preempted run that wrote its checkpoint: every rank meant 75, nothing to warn about
    ({0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED, []),
    ({0: EXIT_PREEMPTED, 1: ABRT}, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED, ["rank 1 (signal"]),
    # no mark: a real failure, whatever the codes; the rank that failed named, not the agent's SIGTERM
    ({0: TERM, 1: ABRT}, {}, 1, ["error: rank 1 (signal SIGABRT) failed", "1 other rank(s) stopped with it"]),
    ({0: 1}, {}, 1, ["error: rank 0 (exit code 1) failed;"]),
    ({0: EXIT_USAGE, 1: TERM}, {}, EXIT_USAGE, []),  # the rank printed its own line
    ({0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, {}, EXIT_PREEMPTED, []),
])
def test_failed_launch_decision(codes, completed, code, words):
    got, line = failed_launch(codes, completed)
    assert got == code
    assert (line == "") == (not words), line
    for word in words:
        assert word in line, line
    assert "\n" not in line


def test_marks_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(COMPLETED_ENV, str(tmp_path))
    for rank, code in ((0, 0), (1, EXIT_PREEMPTED)):
        monkeypatch.setenv("RANK", str(rank))
        mark_completed(code)
    (tmp_path / "rank-7").write_text("")  # cut short as its rank was killed: not a mark
    assert read_completed(tmp_path) == {0: 0, 1: EXIT_PREEMPTED}
    monkeypatch.delenv(COMPLETED_ENV)
    mark_completed(0)  # not under the launcher: nothing to tell, nothing written


@pytest.mark.parametrize("codes, notes, code, words", [
    # bad input only rank 1 saw (rank 0, which prints the job's line, was waiting in a collective):
    # its line, once, whether the agent killed rank 0 or its collective failed first
    ({0: TERM, 1: EXIT_USAGE}, {ERROR_NOTE: {1: LINE}}, EXIT_USAGE, [f"error: {LINE}"]),
    ({0: EXIT_CRASH, 1: EXIT_USAGE}, {ERROR_NOTE: {1: LINE}, PEER_NOTE: {0: ""}}, EXIT_USAGE, [f"error: {LINE}"]),
    ({0: EXIT_CRASH, 1: EXIT_USAGE, 2: EXIT_USAGE}, {ERROR_NOTE: {2: "other", 1: LINE}}, EXIT_USAGE, [LINE]),
    # rank 0 had it too and printed it: not again
    ({0: EXIT_USAGE, 1: EXIT_USAGE}, {ERROR_NOTE: {1: LINE}}, EXIT_USAGE, []),
    # rank 1 killed (kill -9, the OOM killer), rank 0's collective failed with it: rank 1 named
    ({0: EXIT_CRASH, 1: KILL}, {PEER_NOTE: {0: ""}}, 1, ["error: rank 1 (signal SIGKILL) failed;", "1 other"]),
    ({0: TERM, 1: EXIT_CRASH, 2: EXIT_CRASH}, {PEER_NOTE: {2: ""}}, 1, ["error: rank 1 (exit code 1) failed;",
                                                                     "2 other rank(s)"]),
])
def test_a_failure_one_rank_saw_is_one_line_naming_it(codes, notes, code, words):
    got, line = failed_launch(codes, {}, notes)
    assert got == code
    assert (line == "") == (not words), line
    for word in words:
        assert word in line, line
    assert "\n" not in line


def _as_rank(monkeypatch, tmp_path, rank: int, world: int = 2) -> None:
    """This process as rank `rank` of a `--nproc` launch whose folder is `tmp_path`."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29500),
                        (COMPLETED_ENV, tmp_path)):
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("launched", [True, False])
def test_a_rank_leaves_its_failure_for_the_launcher(tmp_path, tmp_path_factory, monkeypatch, capfd, launched):
    """In process: a rank other than 0 whose command raised bad input rank 0 may not have leaves its
    line for the launcher (printing nothing: rank 0 prints the shared ones), under torchrun in its
    elastic error file, whose message torchrun's failure summary shows; a rank whose collective
    failed because a peer died leaves no traceback, only a note; the launcher reads both back."""
    import shardtune.cli.eval as command  # a command whose work is split over ranks (cli.common.RANKED)

    _as_rank(monkeypatch, tmp_path, 1)
    error_file = tmp_path_factory.mktemp("elastic") / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))  # as torchrun's agent sets it, and ours
    if not launched:  # torchrun's rank: no launcher of ours to tell
        monkeypatch.delenv(COMPLETED_ENV)
    monkeypatch.setattr(command, "run", lambda args: (_ for _ in ()).throw(UserError(LINE + "\nsecond line")))
    assert main(["eval", str(tmp_path)]) == EXIT_USAGE
    assert error_file.exists() != launched  # `--nproc N` says the line itself: no second summary
    if not launched:  # torchrun's summary, as torch formats it from the file
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

        summary = ChildFailedError("shardtune", {1: ProcessFailure(1, 4242, EXIT_USAGE, str(error_file))}).format_msg()
        assert f"error: {LINE}\\nsecond line" in summary and "rank      : 1" in summary, summary
    gone = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")

    def collective(args):
        try:
            raise gone
        except RuntimeError as exc:  # as DCP or a hook retells it: the peer's words in the cause
            raise RuntimeError("checkpoint save failed") from exc

    monkeypatch.setattr(command, "run", collective)
    _as_rank(monkeypatch, tmp_path, 0)
    if not launched:
        monkeypatch.delenv(COMPLETED_ENV)
    assert main(["eval", str(tmp_path)]) == EXIT_CRASH
    err = capfd.readouterr().err
    assert "Traceback" not in err
    if launched:
        assert err == ""
        assert read_notes(tmp_path) == {ERROR_NOTE: {1: LINE + "\\nsecond line"}, PEER_NOTE: {0: ""}}
    else:  # rank 0 of torchrun points to the rank that failed, once
        assert err.count("\n") == 1 and err.startswith("error: another rank of this run failed first"), err
        assert not list(tmp_path.iterdir())
    monkeypatch.setattr(command, "run", lambda args: (_ for _ in ()).throw(ConnectionResetError(
        104, "Connection reset by peer")))  # a socket of its own (an upload): not a collective's peer
    with pytest.raises(ConnectionResetError):
        main(["eval", str(tmp_path)])
    monkeypatch.setattr(command, "run", collective)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a lone process has no peer: its error is its own
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match="checkpoint save failed"):
        main(["eval", str(tmp_path)])


def test_the_agent_does_not_retell_a_stop(monkeypatch):
    """A Ctrl-C of `--nproc N` is the launcher's lines only: the agent's "Received 2 death signal,
    shutting down workers" warning is off, though its module's logger has a level of its own."""
    import logging

    from torch.distributed.launcher.api import elastic_launch  # noqa: F401 - makes the agent's loggers

    names = [n for n in logging.Logger.manager.loggerDict if n.startswith("torch.distributed.elastic.agent.server")]
    for name in names:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)  # put back after
    monkeypatch.setattr(logging.getLogger("torch.distributed.elastic"), "level", logging.NOTSET)
    quiet_agent_loggers()
    assert "torch.distributed.elastic.agent.server.api" in names
    assert not any(logging.getLogger(name).isEnabledFor(logging.WARNING) for name in names)


def test_the_launcher_leaves_its_process_as_it_found_it(monkeypatch):
    """`launch_local` set SHARDTUNE_LAUNCHER_PID and OMP_NUM_THREADS for its ranks in its own
    environment and left them there: a later run in the same process (main() called again, in a
    notebook) took itself for a rank of `--nproc N` and kept the first N's thread count."""
    import os

    import torch.distributed.launcher.api as api

    from shardtune.distributed.process_group import LAUNCHER_ENV
    from shardtune.launch import local

    seen = []

    def fake_launch(config, entrypoint):
        def ranks(*argv):
            seen.append({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", LAUNCHER_ENV, COMPLETED_ENV)})
        return ranks
    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    monkeypatch.setattr(local, "quiet_agent_loggers", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    before = dict(os.environ)
    assert local.launch_local(2, ["train"]) == 0
    assert seen[0][LAUNCHER_ENV] == str(os.getpid()) and seen[0]["OMP_NUM_THREADS"] and seen[0][COMPLETED_ENV]
    assert dict(os.environ) == before
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a user's own count: kept, for the ranks and after
    assert local.launch_local(2, ["train"]) == 0
    assert seen[1]["OMP_NUM_THREADS"] == "3" and os.environ["OMP_NUM_THREADS"] == "3"
    # a Slurm job's 16 cores of a machine's 128 (its cpuset): 4 threads for each of 4 ranks, not 32
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert local.launch_local(4, ["train"]) == 0
    assert seen[2]["OMP_NUM_THREADS"] == "4"
