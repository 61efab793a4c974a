"""The one set of argparse types every command's options use: each checks type, range, NaN/inf
and emptiness while the command line is parsed, so no command starts work on a value it cannot
use. A refusal is argparse's own error, which `main.OneLineParser` prints as one line (exit 2).
Imports nothing heavy: `--help` stays fast."""

from __future__ import annotations

import argparse
import math
import os
import re
import stat

INT_LIMIT = 2 ** 63 - 1  # the largest count or seed torch and numpy take without overflow


def _int(text: str, least: int, most: int) -> int:
    try:
        value = int(str(text).strip().replace("_", ""), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not least <= value <= most:
        shown = value if abs(value) < 10 ** 30 else f"a number of {len(str(abs(value)))} digits"
        why = f"at least {least}" + (f" and at most {most}" if most < INT_LIMIT else "") if value < least \
            else f"at most {most}" + (" (2**63-1)" if most == INT_LIMIT else "")
        raise argparse.ArgumentTypeError(f"must be {why}, got {shown}")
    return value


def int_range(least: int = 0, most: int = INT_LIMIT):
    """A whole number in [least, most] (no floats, no bools, no overflow)."""
    def parse(text: str) -> int:
        return _int(text, least, most)

    parse.__name__ = "integer"
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
ranks = int_range(1, 1024)  # local ranks: each is a process with its own copy of the libraries


def finite_float(least: float | None = None, most: float | None = None, *, above: float | None = None,
                 below: float | None = None):
    """A finite number, optionally in [least, most] or (above, below)."""
    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        for bound, ok, word in ((least, lambda b: value >= b, "at least"), (most, lambda b: value <= b, "at most"),
                                (above, lambda b: value > b, "above"), (below, lambda b: value < b, "below")):
            if bound is not None and not ok(bound):
                raise argparse.ArgumentTypeError(f"must be {word} {bound}, got {value}")
        return value

    parse.__name__ = "number"
    return parse


positive_float = finite_float(above=0)
probability = finite_float(0, 1)  # a share or probability, both ends included


def nonempty_str(text: str) -> str:
    """Text that is not empty or blank (a name, a hub id, a folder)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if "\x00" in text:
        raise argparse.ArgumentTypeError("must not contain a NUL character")
    return text


def fs_path(text: str) -> str:
    """A file or folder name; `~` is the user's home, as in the config's paths: `--out=~/r` is one word
    whose `~` a shell leaves as it is, and the command wrote ./~/r while it said ~/r."""
    return os.path.expanduser(nonempty_str(text))


def size(text: str) -> str:
    """A memory size (16GiB, 80GB, 15360MiB): checked here, kept as written (the callers parse it)."""
    from shardtune.errors import UserError
    from shardtune.hardware import parse_size

    try:
        if parse_size(nonempty_str(text), "size") >= 2 ** 63:
            raise argparse.ArgumentTypeError(f"{text!r} is larger than any machine's memory")
    except UserError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; write it like 16GiB, 80GB or "
                                         "15360MiB") from None
    return text


def size_bytes(text: str) -> int:
    """A memory size as bytes, for an option whose value goes to a library: its own size grammar
    differs (huggingface_hub's takes no GiB, MiB or B), so it gets the number, never the text."""
    from shardtune.hardware import parse_size

    return parse_size(size(text), "size")


def hub_repo(text: str) -> str:
    """A Hub repo id (namespace/name), checked by the rule publish.hub_repo follows."""
    from shardtune.config.validation import is_repo_id

    if not is_repo_id(str(text).strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Hub repo id; write namespace/name (letters, digits, "
                                         "- _ .), e.g. my-user/my-model")
    return text.strip()


def slurm_time(text: str) -> str:
    """A Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    if not re.fullmatch(r"(\d+-)?\d{1,7}(:\d{1,2}){0,2}", str(text).strip()) or not any(c in "123456789" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Slurm time limit; write it like 24:00:00 or 2-00:00:00")
    return text.strip()


def regular_file(text: str) -> str:
    """An existing regular file (not a folder, FIFO or device: reading those hangs or never ends)."""
    text = fs_path(text)
    try:
        mode = os.stat(text).st_mode
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file")
    return text
