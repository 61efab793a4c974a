"""The launcher tells a rank that died after the run completed from one that failed: ranks mark
the run completed after its closing barrier (`mark_completed`), and `failed_launch` decides."""

from __future__ import annotations

import signal

import pytest

from shardtune.errors import EXIT_PREEMPTED, EXIT_USAGE
from shardtune.launch.local import failed_launch, read_completed
from shardtune.rank.lifecycle import COMPLETED_ENV, mark_completed

ABRT, TERM = -int(signal.SIGABRT), -int(signal.SIGTERM)


@pytest.mark.parametrize("codes, completed, code, words", [
    # the case: rank 1 aborted at interpreter exit, the agent killed rank 0; both had marked
    ({0: TERM, 1: ABRT}, {0: 0, 1: 0}, 0, ["warning:", "rank 0 (signal SIGTERM)", "rank 1 (signal SIGABRT)",
                                          "after the run had completed"]),
    # rank 0 was killed before writing its mark: rank 1's mark says both passed the barrier
    ({0: TERM, 1: ABRT}, {1: 0}, 0, ["warning:", "after the run had completed"]),
    # a preempted run that wrote its checkpoint: every rank meant 75, nothing to warn about
    ({0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED, []),
    ({0: EXIT_PREEMPTED, 1: ABRT}, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED, ["rank 1 (signal"]),
    # no mark: a real failure, whatever the codes
    ({0: TERM, 1: ABRT}, {}, 1, ["error: 2 worker(s) failed", "-15", "-6"]),
    ({0: 1}, {}, 1, ["error: 1 worker(s) failed"]),
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
