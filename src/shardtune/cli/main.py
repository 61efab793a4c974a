"""`shardtune` command line: the parser and the dispatch. Each command is one module of this package
with `add_parser(sub)` and `run(args)`. Imports stay lazy: `--help` must not load torch or transformers."""

from __future__ import annotations

import argparse
import codecs
import gc
import importlib
import os
import sys

from shardtune.cli.common import TRAIN_EPILOG, config_reference
from shardtune.errors import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_USAGE, RankError, UserError

COMMANDS = ("train", "export", "eval", "generate", "report", "slurm", "plan", "sweep", "download")  # --help order


def one_line(text: str) -> str:
    """An error message as one line whatever it quotes (a value with a newline in it stays visible)."""
    return text.strip().replace("\r", "\\r").replace("\n", "\\n")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the usage block and then the error; every bad input here is one line,
    exit 2, like a UserError (subparsers inherit this class)."""

    def error(self, message: str):
        text = one_line(message)
        self.exit(EXIT_USAGE, f"error: {self.prog}: {text}; see `{self.prog} --help`\n")


def prints_errors(exc: BaseException | None = None) -> bool:
    """Rank 0 prints the one error line for all ranks; so does a lone process whatever RANK says,
    and any rank whose own launcher variables are wrong (a RankError)."""
    from shardtune.distributed.process_group import is_main_process

    return isinstance(exc, RankError) or is_main_process()


def build_parser() -> argparse.ArgumentParser:
    from shardtune import __version__

    parser = OneLineParser(prog="shardtune", description="Fine-tune Hugging Face causal LMs "
                                     "with PyTorch FSDP2 from one YAML config and one command.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="`shardtune train --help` shows the options of train.\n"
                                     + TRAIN_EPILOG + config_reference())
    parser.add_argument("--version", action="version", version=f"shardtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"shardtune.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shardtune.console import guarded_console

    if argv is None:
        in_utf8_mode()
    with guarded_console() as console:
        code = _main(argv, console)
    if argv is None:  # the program's end (console script, python -m shardtune): the teardown's
        # collections would walk every object torch and transformers made, seconds after the last
        # line; atexit handlers still run and reference counting frees the rest
        gc.freeze()
    return code


def in_utf8_mode() -> None:
    """Under the C or POSIX locale with PYTHONUTF8=0, Python encodes file names, files and the
    console as ASCII: a path, a recipe value or a generated word outside it crashed wherever it
    was met (a folder made, a script written, a line printed). The libraries read and write UTF-8
    whatever the locale, so the command starts again in Python's UTF-8 mode: the same process id,
    the same arguments as bytes; its ranks and trials inherit it. An explicit `-X utf8=0` is kept."""
    if sys.flags.utf8_mode or codecs.lookup(sys.getfilesystemencoding()).name == "utf-8" \
            or os.environ.get("PYTHONUTF8") == "1":  # set: this is the second start
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONUTF8": "1"})


def undecodable_word(argv: list[str]) -> str | None:
    """The first word of the command line that is not UTF-8 text, or None. A name in another
    encoding (a byte like 0xff) reaches Python as a lone surrogate, which Python's own file calls
    accept but the tokenizer's and other libraries' do not: a run failed only when it saved its
    model, its training lost."""
    for word in argv:
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            return os.fsencode(word).decode("utf-8", "backslashreplace")
    return None


PRINTS_ITS_PRODUCT = ("plan", "generate", "eval", "slurm")


def stops_when_reader_leaves(args: argparse.Namespace) -> bool:
    """A command whose product is what it prints (unless --out names a file) ends when nobody reads
    it any more: the rest of its work would be lost. The others make files, which a closed console
    does not touch, and a rank of several goes on with its peers whatever its command."""
    return (args.command in PRINTS_ITS_PRODUCT and not getattr(args, "out", None)
            and os.environ.get("WORLD_SIZE", "1").strip() == "1")


def _main(argv: list[str] | None, console) -> int:
    try:  # a working directory removed under the shell: relative paths mean nothing, and torch's MKL dies loading
        os.getcwd()
    except OSError as exc:
        print(f"error: the working directory cannot be read ({exc.strerror}: it was removed, or its permissions "
              "changed); cd to an existing folder and run again", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if (word := undecodable_word(argv)) is not None:
        print(f"error: '{word}' on the command line is not UTF-8 text (a name in another encoding); rename the "
              "file or folder to a UTF-8 name, or link to it from one", file=sys.stderr)
        return EXIT_USAGE
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # a bad option (one line printed), --help or --version: their exit code
        return exc.code if isinstance(exc.code, int) else 0
    args.argv = argv
    # key=value words after an option (`--nproc 2 train.lr=1e-3`) land in `extra`; any other
    # word there goes along too, so load_config reports it as an override that is not key=value.
    if extra and (args.command not in ("train", "slurm", "plan", "sweep") or any(w.startswith("-") for w in extra)):
        try:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit as exc:
            return exc.code
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    console.stop = stops_when_reader_leaves(args)
    from shardtune.noise import quiet_third_party
    from shardtune.rank.lifecycle import die_with_launcher

    quiet_third_party()
    die_with_launcher()  # a rank of `--nproc N` or torchrun: no training on after its launcher is gone
    try:
        from shardtune.cli.common import check_one_process, check_only_with

        check_one_process(args)
        check_only_with(args)
        return importlib.import_module(f"shardtune.cli.{args.command}").run(args)
    except UserError as exc:
        if prints_errors(exc):
            print(f"error: {one_line(str(exc))}", file=sys.stderr)
        else:  # rank 0 prints the job's line, but may not have this rank's: `--nproc N`'s launcher then says it
            from shardtune.rank.lifecycle import ERROR_NOTE, leave_note

            leave_note(ERROR_NOTE, one_line(str(exc)))
        return EXIT_USAGE
    except KeyboardInterrupt:  # train says what is left of a run itself; this is any other moment or command
        from shardtune.distributed.process_group import LAUNCHER_ENV

        if prints_errors() and LAUNCHER_ENV not in os.environ:  # a rank of `--nproc N`: its launcher says it
            print(f"interrupted (Ctrl-C): shardtune {args.command} stopped before it finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: B036 - DCP's CheckpointException is a BaseException
        # the filesystem failing at any output of any command (a full disk, a path through a
        # file, no permission, read-only): one line naming the path, here and nowhere else
        from shardtune.fsio import fs_failure_line

        line = fs_failure_line(exc, getattr(args, "out", None) or f"the output of `shardtune {args.command}`")
        if line is None:
            from shardtune.rank.lifecycle import COMPLETED_ENV, PEER_NOTE, failed_with_a_peer, leave_note

            if not failed_with_a_peer(exc):
                raise
            # another rank failed first and said why (a bad-input line, a traceback) or was killed:
            # not a traceback per surviving rank; `--nproc N`'s launcher names the rank, else rank 0 points to it
            leave_note(PEER_NOTE)
            if COMPLETED_ENV not in os.environ and prints_errors():
                print("error: another rank of this run failed first (see its output above, or its launcher's "
                      "summary), and this one stopped with it", file=sys.stderr)
            return EXIT_CRASH
        if prints_errors():
            print(f"error: {line}", file=sys.stderr)
        return EXIT_USAGE
