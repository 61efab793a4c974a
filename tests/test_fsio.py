"""fsio's one line for a filesystem failure: the kinds of failure, and the variable to change where
the environment chose the folder."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import run_cli
from shardtune.fsio import ENV_FOLDERS, fs_failure_line


@pytest.mark.parametrize("code", [errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EACCES, errno.EROFS])
@pytest.mark.parametrize("name", ENV_FOLDERS)
def test_a_folder_the_environment_chose_names_its_variable(monkeypatch, tmp_path, name, code):
    for other in ENV_FOLDERS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, str(tmp_path / "cache") + "/")
    line = fs_failure_line(OSError(code, os.strerror(code), str(tmp_path / "cache" / "sub")), "-")
    assert line.startswith(f"cannot write '{tmp_path / 'cache' / 'sub'}'") and f"set {name} to a folder" in line, line
    line = fs_failure_line(OSError(code, os.strerror(code), str(tmp_path / "cache-2" / "sub")), "-")
    assert "choose another path" in line and name not in line, line  # only a path inside it


def test_a_folder_written_meanwhile_is_one_line(tmp_path):
    """Two commands into one folder: the finished partial folder renamed onto what the other wrote
    meanwhile (ENOTEMPTY) was a traceback; it is named by the folder it was to become."""
    from shardtune.fsio import atomic_dir

    final = tmp_path / "final"
    with pytest.raises(OSError) as caught:
        with atomic_dir(final) as tmp:
            (tmp / "mine").write_text("1")
            final.mkdir()
            (final / "theirs").write_text("2")  # another process's save, during ours
    line = fs_failure_line(caught.value, "-")
    assert line.startswith(f"cannot write '{final}'") and "another process wrote there meanwhile" in line, line
    assert (final / "theirs").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["final"]


def test_the_innermost_variable_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    line = fs_failure_line(FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "datasets")), "-")
    assert "set HF_DATASETS_CACHE" in line, line


@pytest.mark.parametrize("name, under, fix", [
    ("HF_DATASETS_CACHE", "a-file", "HF_DATASETS_CACHE"),
    ("SHARDTUNE_CACHE", "a-file/x", "SHARDTUNE_CACHE"),
    ("XDG_CACHE_HOME", "a-file/x", "SHARDTUNE_CACHE"),
    ("HOME", "a-file", "SHARDTUNE_CACHE"),
    ("SHARDTUNE_CACHE", "/proc/no-such-folder", "SHARDTUNE_CACHE"),  # mkdir there: ENOENT
])
def test_a_cache_folder_the_environment_spoils_is_one_line(tmp_path, name, under, fix):
    """HF_DATASETS_CACHE set to a file: datasets' makedirs raised FileExistsError (EEXIST), which
    the handler did not know, as a traceback; a quickstart cache under /proc, FileNotFoundError;
    the others named a path but not the variable that chose it."""
    (tmp_path / "a-file").write_text("mine\n")
    env = {"SHARDTUNE_CACHE": "", "XDG_CACHE_HOME": "", name: str(tmp_path / under)}  # "": unset
    proc = run_cli(["train", "train.max_steps=1", f"output_dir={tmp_path / 'run'}"], timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"set {fix} to a folder you can write" in proc.stderr.splitlines()[-1]
    assert (tmp_path / "a-file").read_text() == "mine\n" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("opening", ["[", '{"a":'])
def test_json_nested_past_the_recursion_limit_is_a_decode_error(opening):
    """json.loads raises RecursionError there, which no `except ValueError` catches (a data file's
    line of 5,000 brackets escaped train as a traceback); ruff bans json.loads in src/ for this."""
    import json

    from shardtune.fsio import json_loads

    with pytest.raises(json.JSONDecodeError, match="nested deeper"):
        json_loads(opening * 5000)
    assert json_loads('{"a": [[1]]}') == {"a": [[1]]}


def test_a_data_line_nested_too_deep_is_named(tmp_path):
    from shardtune.data.files import first_line_not_an_object

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n' + "[" * 5000 + "\n")
    assert first_line_not_an_object([str(data)]).startswith(f"line 2 of {str(data)!r} is not JSON (nested deeper")


@pytest.mark.parametrize("name", [".", "./", "sub/..", "{cwd}"])
def test_a_folder_written_whole_is_never_the_working_directory(monkeypatch, tmp_path, name):
    """`export RUN .` and `report RUN --out .` escaped as a traceback (`.` has no name to make a
    temporary sibling of); `DIR/.` was renamed onto the working directory, leaving the shell in a
    removed folder that looked empty."""
    from shardtune.errors import UserError
    from shardtune.fsio import atomic_dir

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="is the working directory"), atomic_dir(name.format(cwd=tmp_path)):
        pass
    assert os.listdir(tmp_path) == ["sub"]


def test_a_link_to_a_folder_is_written_through(tmp_path):
    """A folder written whole, named by a link to a folder (out -> /bigdisk/model): its target is
    filled or replaced and the link kept (a rename onto the link failed as 'Not a directory')."""
    from shardtune.fsio import atomic_dir

    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    for text in ("first", "second"):
        with atomic_dir(tmp_path / "link", replace=True) as tmp:
            (tmp / "a.txt").write_text(text)
    assert os.readlink(tmp_path / "link") == "target" and sorted(os.listdir(tmp_path)) == ["link", "target"]
    assert (tmp_path / "target" / "a.txt").read_text() == "second"


def test_nothing_is_written_inside_what_a_runs_overwrite_removes(tmp_path):
    """report/, tensorboard/, mlruns/, wandb/ go with a run when its --overwrite replaces it: a new
    run, an export or a cache put inside one was deleted with them. report/ itself stays report's."""
    from shardtune.errors import UserError
    from shardtune.fsio import RUN_MARKS, RUN_OUTPUT_DIRS, refuse_inside_run

    for name in RUN_MARKS:
        (tmp_path / name).write_text("")
    for inner in RUN_OUTPUT_DIRS:
        for out in (tmp_path / inner, tmp_path / inner / "new"):
            with pytest.raises(UserError, match=f"inside {inner}/ of the run in"):
                refuse_inside_run(out, "output_dir")
    refuse_inside_run(tmp_path / "report", "report folder", own="report")
    with pytest.raises(UserError, match="inside report/"):
        refuse_inside_run(tmp_path / "report" / "old", "report folder", own="report")
