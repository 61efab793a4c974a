"""The console when its reader leaves: `shardtune plan … | head -3`.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError in
whichever line printed next, deep in any command, and the interpreter's own flush at exit prints
one more traceback. `guarded_console` wraps both streams once per command, so the decision is made
here and nowhere else: the stream is pointed at /dev/null (later writes, the exit flush and C
code's writes land there), and then a command whose product is what it prints stops at once,
quietly, with the shell's code for it; a command that makes files (a training run) goes on
without its console, since its results are not the console's."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from shardtune.errors import EXIT_READER_LEFT


class ReaderLeft(SystemExit):
    """Nobody reads what this command prints any more: it ends, with no message (there is nobody
    to read one)."""

    def __init__(self) -> None:
        super().__init__(EXIT_READER_LEFT)


def _reader_gone(exc: OSError) -> bool:
    return isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE


class _Guarded:
    """A text stream that survives its reader leaving; everything else is the stream's own."""

    def __init__(self, stream, policy: Policy | None) -> None:
        self._stream, self._policy, self.reader_left = stream, policy, False

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _left(self) -> None:
        self.reader_left = True
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream without a real descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        with contextlib.suppress(OSError, ValueError):  # what was buffered for the pipe goes to /dev/null
            self._stream.flush()
        if self._policy is not None and self._policy.stop:
            raise ReaderLeft()

    def write(self, text: str) -> int:
        if not self.reader_left:
            try:
                return self._stream.write(text)
            except OSError as exc:
                if not _reader_gone(exc):
                    raise
                self._left()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def close(self) -> None:
        """Only flushed: the process's stream is not the wrapper's to close. A library's log handler
        closes the stream it took at exit (absl's, which rouge-score sets up, when the stream is not
        the sys.stderr of that moment: this wrapper, once the command is over), and the rank's own
        exit (lifecycle.leave_rank) then died flushing a closed stderr."""
        self.flush()

    def flush(self) -> None:
        if self.reader_left:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            if not _reader_gone(exc):
                raise
            self._left()


class Policy:
    """`stop`: when the reader of stdout leaves, end the command (ReaderLeft), else go on without a
    console; set once the command is known. A reader of stderr leaving never stops a command."""

    stop = False


@contextlib.contextmanager
def guarded_console():
    """Inside the block, sys.stdout and sys.stderr survive a reader that leaves; yields the Policy."""
    policy, saved = Policy(), (sys.stdout, sys.stderr)
    if sys.stdout is not None:
        sys.stdout = _Guarded(sys.stdout, policy)
    if sys.stderr is not None:
        sys.stderr = _Guarded(sys.stderr, None)
    try:
        yield policy
    finally:
        sys.stdout, sys.stderr = saved
