"""The one exception type that means "the user asked for something we can't do", and the exit
codes every command and rank ends with."""

import signal

EXIT_CRASH = 1  # a crash: a traceback above, or another rank's failure that this rank stopped with
EXIT_USAGE = 2  # bad input: one line on stderr, nothing written destroyed
# A run stopped on request (SIGTERM, SIGUSR1, one Ctrl-C) after writing a checkpoint. 75 is
# EX_TEMPFAIL, "temporary failure, try again": a requeue script can treat it as "requeue me",
# e.g. `[ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID`.
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 128 + signal.SIGINT  # the shell's code for a process stopped by Ctrl-C
EXIT_READER_LEFT = 128 + signal.SIGPIPE  # the shell's code for a writer whose reader left (`| head`)


class UserError(Exception):
    """Bad input. The CLI prints it as a single line and exits with code 2, no traceback.

    The message should name the problem and the fix.
    """


class RankError(UserError):
    """Bad input of this process alone (its launcher's variables): every rank that has it says
    it, not rank 0 only (which may not have it, or may be waiting for this rank)."""


def first_line(exc: BaseException, limit: int = 200, last: bool = False) -> str:
    """One line of an exception's text for a UserError message: the first line (or the `last`,
    for errors that carry a retold traceback), at most `limit` characters; the type's name when
    the exception has no text."""
    lines = str(exc).strip().splitlines()
    return (lines[-1] if last else lines[0])[:limit] if lines else type(exc).__name__
