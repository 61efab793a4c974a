"""Writing outputs without ever leaving something that looks finished but is not, and one line
for any filesystem failure at any output (the CLI's handler calls `fs_failure_line`).

- `atomic_dir(final)`: build a folder under a temporary sibling name, rename it into place when
  complete; a failure removes the partial folder (a half-written model folder would otherwise
  load as a model). Its files get the permissions the umask gives (safetensors writes 0600).
- `write_text_atomic(path, text)`: the same for one file; `sync_files(paths)`: on disk before a
  mark that says they are whole (a checkpoint's meta.json).
- `refuse_foreign(folder, ...)`, `refuse_foreign_file(path, ...)`: a command replaces only a folder
  or a file of its own kind, and writes nothing inside a run's own folders (`refuse_inside_run`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
from pathlib import Path

from shardtune.diskspace import causes, no_room
from shardtune.errors import UserError


def json_loads(text: str):
    """json.loads for text a user, a kill or a full disk may have damaged: JSON nested deeper than
    Python's recursion limit raises the JSONDecodeError (a ValueError) every caller catches, not a
    RecursionError, which none did."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested deeper than the JSON reader goes", text[:200], 0) from None


PARTIAL = ".partial-"  # .NAME.partial-PID: a folder or file being written
# errno -> what the user can do about it (the path is always named)
FS_ERRORS = {
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "a file is in the way of a folder",  # os.makedirs onto a file
    errno.ENOTEMPTY: "another process wrote there meanwhile",  # a finished folder renamed onto a new one
    errno.EISDIR: "it is a folder, where a file is expected",
    errno.EACCES: "no permission there",
    errno.EPERM: "no permission there",
    errno.EROFS: "that file system is read-only",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ELOOP: "the path has a loop of symlinks",
}
# Folders that the environment chooses, where a failing path is more often the variable's fault
# than the command line's: the line names the variable to change.
ENV_FOLDERS = ("SHARDTUNE_CACHE", "SHARDTUNE_PLAN_CACHE", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE",
               "HF_DATASETS_CACHE", "HF_XET_CACHE", "TRANSFORMERS_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
               "WANDB_DIR")


def partial_name(final: Path) -> Path:
    return final.with_name(f".{final.name}{PARTIAL}{os.getpid()}")


def published(path: str) -> str:
    """A path inside a partial folder, told by the name it was to have."""
    return re.sub(r"\.([^/]+)" + re.escape(PARTIAL) + r"\d+", r"\1", path)


def make_dir(folder: Path) -> None:
    """mkdir -p, with a file in the way told as such (not as "File exists") by the handler."""
    folder = Path(folder)
    first = folder
    while not os.path.lexists(first) and first.parent != first:
        first = first.parent
    if os.path.lexists(first) and not first.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(first))
    folder.mkdir(parents=True, exist_ok=True)


def whole_folder(final: Path, option: str = "output folder") -> Path:
    """Where `atomic_dir(final)` renames its folder: `.` or `x/..` as the folder they name (they
    have no name of their own to make a sibling of), a link to a folder as the folder it leads to
    (renamed onto, the link failed as "Not a directory"; the link stays). The working directory is
    refused: renamed onto, it would leave the shell in a removed folder that looks empty."""
    final = Path(final)
    if final.name in ("", ".."):
        final = final.resolve()
    elif final.is_symlink() and final.is_dir():
        final = Path(os.path.realpath(final))
    if final.resolve() == Path.cwd().resolve():
        raise UserError(f"{option} {str(final)!r} is the working directory, which would be replaced whole; "
                        "name a new folder in it (e.g. ./model), or run from the folder above")
    return final


@contextlib.contextmanager
def atomic_dir(final: Path, replace: bool = False):
    """Yield a fresh temporary sibling of `final` to fill; when the block ends without error it
    becomes `final` (an empty `final` is replaced; a non-empty one only with `replace`, else it
    is an error). On any failure the partial folder is removed and nothing else changes."""
    final = whole_folder(final)
    make_dir(final.parent)
    tmp = partial_name(final)
    for stale in [tmp, *dead_partials(final)]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        share_as_umask(tmp)
        if replace and final.is_dir() and not final.is_symlink() and any(final.iterdir()):
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)  # over an empty folder, or none
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def process_umask() -> int:
    """This process's umask, read without setting it (os.umask can only set it: a moment in which
    another thread's new files would get the wrong mode)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def share_as_umask(folder: Path) -> None:
    """Give each file under `folder` the read/write permissions the umask allows, as a file opened
    by the command itself gets: safetensors writes its files owner-only (0600), so a model folder
    handed to a colleague or a serving account could not be read. Nothing is taken away."""
    allowed = 0o666 & ~process_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode & 0o7777
            if mode | allowed != mode:
                with contextlib.suppress(PermissionError):  # another account's file (a shared folder): as it is
                    os.chmod(path, mode | allowed)


def dead_partials(final: Path) -> list[Path]:
    """Partial siblings of `final` left by this machine's processes that are gone (a kill -9)."""
    dead = []
    for path in final.parent.glob(f".{glob.escape(final.name)}{PARTIAL}*"):
        pid = path.name.rpartition(PARTIAL)[2]
        if pid.isdigit() and not _alive(int(pid)):
            dead.append(path)
    return dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def write_text_atomic(path: Path, text: str, sync: bool = False) -> None:
    """`path` holds either its old text or all of `text`, never a part."""
    path = Path(path)
    tmp = partial_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sync_files(paths) -> None:
    """fsync each file of `paths`: on disk before a mark written after them (a checkpoint's meta.json)
    says they are whole, a power loss may not keep the mark and lose them."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def broken_link(path: Path) -> str | None:
    """What a link that leads nowhere is, said for a message ("a link to 'x', which does not
    exist", or one that loops), or None when `path` is no such link."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a link to {os.readlink(path)!r} that leads back to itself (a loop)"
    return f"a link to {os.readlink(path)!r}, which does not exist"


def refuse_non_folder(folder: Path, option: str) -> None:
    """An output folder's path that holds something else: a file, or a link that leads nowhere
    (followed, a write would create whatever the link names, wherever that is)."""
    if folder.is_dir() or not os.path.lexists(folder):
        return
    if (link := broken_link(folder)) is not None:
        raise UserError(f"{option} {str(folder)!r} is {link}; create that folder, or choose another {option}")
    raise UserError(f"{option} {str(folder)!r} is a file; choose another {option}")


RUN_MARKS = ("config.yaml", "metrics.jsonl")  # every run writes both: a folder with them is a run
RUN_DIRS = ("final", "checkpoints", "profile", "publish")  # a run's own folders, replaced by its saves
# written about a run by its trackers and by `report`: removed with it by --overwrite, moved aside by resume=auto
RUN_OUTPUT_DIRS = ("tensorboard", "mlruns", "wandb", "report")


def enclosing_run(out: Path, own: str | None = None) -> tuple[Path, str] | None:
    """(a run's folder, which of its RUN_DIRS or RUN_OUTPUT_DIRS) when `out` is, or lies inside, a
    folder of another run that the run itself replaces or removes (--overwrite, checkpoint rotation,
    its final save); `own`: the one such folder the command writes as a whole (report's report/). A
    run is a folder with all of RUN_MARKS, so a user's own folder named final/ is not one."""
    path = Path(out).resolve()
    for inner in (path, *path.parents):
        if inner.name in RUN_DIRS + RUN_OUTPUT_DIRS and not (inner == path and inner.name == own) \
                and all((inner.parent / name).is_file() for name in RUN_MARKS):
            return inner.parent, inner.name
    return None


def refuse_inside_run(out: Path, option: str, own: str | None = None) -> None:
    """An output inside a run's own folders (checkpoints/, final/, report/, ...) is replaced by that
    run's saves or removed by its --overwrite: refused, for every command that writes one."""
    if (owner := enclosing_run(out, own)) is not None:
        run, inner = owner
        raise UserError(f"{option} {str(out)!r} is or lies inside {inner}/ of the run in {str(run)!r}, which that "
                        f"run's --overwrite or its saves replace; choose another {option} outside it")


def refuse_foreign(folder: Path, option: str, kind: str, ours, own: str | None = None) -> None:
    """Refuse to write into `folder` when it holds anything `ours(name)` does not claim (another
    run, a user's files), or lies inside a run's own folders: only a folder of the command's own
    kind is replaced without asking."""
    refuse_non_folder(folder, option)
    refuse_inside_run(folder, option, own)
    if not folder.is_dir():
        return
    foreign = sorted(p.name for p in folder.iterdir() if not ours(p.name) and PARTIAL not in p.name)
    if foreign:
        raise UserError(f"{option} {str(folder)!r} holds files that are not {kind} ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}); nothing was changed; choose a new or empty folder")


def refuse_foreign_file(path: Path, option: str, kind: str, mark: str, overwrite: bool = False) -> None:
    """Refuse to replace the file `path` unless its text holds `mark` (the command wrote it) or
    `overwrite`: a command's output file never takes the place of a user's file unasked."""
    path = Path(path)
    if os.path.isdir(path):
        raise UserError(f"{option} {str(path)!r} is a folder; give a file name")
    refuse_inside_run(path, option)
    if overwrite or not os.path.lexists(path):
        return
    try:
        with open(path, errors="replace") as f:
            ours = mark in f.read(1 << 20)
    except OSError:
        ours = False
    if not ours:
        raise UserError(f"{option} {str(path)!r} exists and is not {kind}; nothing was changed; choose another "
                        "file name" + (" or pass --overwrite" if option.startswith("--") else ""))


def fs_failure_line(exc: BaseException, fallback: str) -> str | None:
    """One line for a failure of the filesystem anywhere in `exc`'s chain (a full disk, a path
    through a file, no permission, a read-only disk), naming the path; None for anything else."""
    if (why := no_room(exc, 0, None)) is not None:
        where = next((e.filename for e in causes(exc) if isinstance(e, OSError) and e.filename), None)
        return (f"{why} while writing {published(str(where or fallback))}; free space there or write to another "
                "disk, and run again")
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in FS_ERRORS and e.filename:
            path = published(str(e.filename))
            name = env_folder(path)
            fix = f"set {name} to a folder you can write" if name else "choose another path"
            return f"cannot write {path!r}: {e.strerror} ({FS_ERRORS[e.errno]}); {fix}, or fix the folder's " \
                   "permissions or mount"
    return None


def env_folder(path: str) -> str | None:
    """The variable of ENV_FOLDERS whose folder holds `path` (the innermost), if any."""
    held = [(len(value), name) for name in ENV_FOLDERS
            if (value := os.path.normpath(os.environ.get(name) or "/")) != "/"
            and (path == value or path.startswith(value + os.sep))]
    return max(held)[1] if held else None
