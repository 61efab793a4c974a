"""Failures a user can cause or suffer end cleanly, and every message about them is true:
the quickstart's defaults stay out of a user's own model and data, broken files and output
folders that cannot be made are one line before anything is built, Ctrl-C stops with a
checkpoint (or, twice, at once) and says which, a full disk during a save is one line with the
partial save removed, and one live run per folder. All in this process through
`shardtune.cli.main.main` (fixtures from test_errors); the `--nproc 2` cases are in test_launcher.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_errors import TINY_GPT2, _isolated, datasets_cache, fails, out, qs_assets, recipe, snapshot  # noqa: F401

from conftest import tmpfs
from shardtune.checkpoint.folders import find_latest, read_meta
from shardtune.checkpoint.rundir import LOCK_FILE, hold_run_dir, release_run_dir
from shardtune.cli.main import main
from shardtune.config.schema import CheckpointConfig
from shardtune.diskspace import space_warning
from shardtune.distributed.process_group import LAUNCHER_ENV
from shardtune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED


@pytest.fixture(scope="session")
def model_dir(qs_assets, tmp_path_factory) -> Path:
    """A user's own model folder: a tiny GPT-2 (512 positions) with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("user-model")
    tokenizer = AutoTokenizer.from_pretrained(qs_assets["tokenizer"])
    config = AutoConfig.for_model(**{**TINY_GPT2, "n_positions": 512, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if a model gets built: the error must come before."""
    import shardtune.train.trainer

    def build(*args, **kw):
        raise AssertionError("the model was built before the error")

    monkeypatch.setattr(shardtune.train.trainer, "build_model", build)


def run_main(capfd, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capfd.readouterr()
    return rc, captured.out, captured.err


# ----------------------------------------------------------------------------- quickstart defaults


def test_quickstart_defaults_step_aside(monkeypatch, qs_assets):
    import shardtune.data.quickstart as qs

    builds = []
    monkeypatch.setattr(qs, "build_quickstart_assets", lambda *a, **k: builds.append(1) or qs_assets)
    tree, line = qs.quickstart_defaults([])
    assert tree["model"]["tokenizer"] == qs_assets["tokenizer"] and "path" in tree["data"]
    assert line == ("quickstart defaults: model and training settings (random-init GPT-2), tokenizer (docstring BPE), "
                    "data (docstring corpus), eval and log cadence")  # every part it uses, the tokenizer too

    tree, line = qs.quickstart_defaults(["model.name_or_path=/my/model", "train.lr=1e-4"])
    assert "model" not in tree and "train" not in tree
    assert tree["data"] == {"path": str(Path(qs_assets["train"]).parent)}
    assert "data (docstring corpus)" in line and "your model replace" in line and "model and training" not in line

    tree, line = qs.quickstart_defaults(["data.path=corpus.jsonl"])
    assert tree["model"]["tokenizer"] == qs_assets["tokenizer"] and "path" not in tree["data"]
    assert "your data replace" in line

    # a model of your own design (its model_type): only the tokenizer and data fit it, not the tiny
    # GPT-2's config, seq_len or lr 3e-3; a model.config without one tweaks the quickstart's GPT-2
    for design in (['model.config={"model_type": "llama", "hidden_size": 64}'], ["model.config.model_type=llama"]):
        tree, line = qs.quickstart_defaults(design)
        assert tree["model"] == {"tokenizer": qs_assets["tokenizer"]} and "train" not in tree
        assert tree["data"] == {"path": str(Path(qs_assets["train"]).parent)}
        assert line.startswith("quickstart defaults: tokenizer (docstring BPE), data (docstring corpus)")
        assert "GPT-2" not in line and "your model.config's model and shardtune's training settings" in line
    tree, line = qs.quickstart_defaults(["model.tokenizer=/my/tokenizer"])  # your tokenizer, the quickstart's GPT-2
    assert "tokenizer" not in tree["model"] and tree["model"]["config"]["model_type"] == "gpt2"
    assert "random-init GPT-2" in line and "tokenizer" not in line
    tree, line = qs.quickstart_defaults(["model.config.n_layer=4"])
    assert tree["model"]["config"]["model_type"] == "gpt2" and tree["train"]["lr"] == 3e-3
    assert "random-init GPT-2" in line

    builds.clear()
    tree, line = qs.quickstart_defaults(["model={name_or_path: /my/model}", "data.path=c.jsonl"])
    assert set(tree) == {"eval", "log"} and not builds  # nothing of the quickstart's is built
    assert "your model and data" in line


def test_own_model_and_data_without_recipe(capfd, monkeypatch, model_dir, qs_assets, tmp_path):
    """The issue's first command: a local model and a data file, no recipe. The quickstart's
    tokenizer and model config used to stay and the run crashed on mismatched sizes."""
    import shardtune.data.quickstart as qs

    monkeypatch.setattr(qs, "build_quickstart_assets", lambda *a, **k: pytest.fail("assets built"))
    out = tmp_path / "run"
    rc, stdout, err = run_main(capfd, ["train", f"model.name_or_path={model_dir}", f"data.path={qs_assets['train']}",
                                       f"output_dir={out}", "train.max_steps=1", "eval.max_batches=1",
                                       "train.global_batch_size=8", "log.progress=false"])
    assert rc == 0, err
    assert stdout.splitlines()[0].startswith("quickstart defaults: eval and log cadence; your model and data")
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["tokenizer"] is None and saved["model"]["config"] == {}
    assert saved["train"]["lr"] == 3e-4 and saved["data"]["seq_len"] == 512  # shardtune's, not the quickstart's


# ----------------------------------------------------------------------------- broken files


def test_recipe_not_text(capfd, tmp_path, out):
    binary = tmp_path / "model.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    fails(capfd, ["train", str(binary), f"output_dir={out}"], "model.yaml", "not a text file", "YAML recipe")
    fails(capfd, ["train", str(tmp_path), f"output_dir={out}"], "is a folder", "YAML file")


@pytest.mark.parametrize("damage, words", [
    ("config_truncated", ["config.json", "not valid JSON"]),
    ("config_missing", ["has no config.json"]),
    ("a_run_folder", ["is a training run, not a model", "/final'"]),  # model.name_or_path=RUN
    ("weights_missing", ["has no weights", "model.random_init=true"]),
    ("weights_truncated", ["model.safetensors", "truncated or damaged"]),
    ("shard_missing", ["lacks model-00002-of-00002.safetensors"]),
    ("tokenizer_truncated", ["tokenizer.json", "not valid JSON"]),
    ("tokenizer_garbled", ["tokenizer folder", "is damaged"]),
])
def test_broken_model_folder(capfd, model_dir, tmp_path, out, qs_assets, no_build, damage, words):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    weights, tok = folder / "model.safetensors", folder / "tokenizer.json"
    if damage == "config_truncated":
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text[: len(text) // 2])
    elif damage == "config_missing":
        (folder / "config.json").unlink()
    elif damage == "a_run_folder":
        shutil.copytree(model_dir, folder / "final")
        (folder / "config.json").unlink()
    elif damage == "weights_missing":
        weights.unlink()
    elif damage == "weights_truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif damage == "shard_missing":
        weights.rename(folder / "model-00001-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    elif damage == "tokenizer_truncated":
        tok.write_text(tok.read_text()[:500])
    else:
        tok.write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
    before = snapshot(out)
    line = fails(capfd, ["train", f"model.name_or_path={folder}", f"data.path={qs_assets['train']}",
                         "data.seq_len=32", f"output_dir={out}"], *words)
    assert str(folder) in line
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- output folders


def test_output_dir_under_a_file(capfd, recipe, tmp_path, no_build):
    (tmp_path / "notes.txt").write_text("a file\n")
    fails(capfd, ["train", recipe, f"output_dir={tmp_path / 'notes.txt' / 'run'}"], "notes.txt",
          "is a file, not a folder", "choose another output_dir")
    assert (tmp_path / "notes.txt").read_text() == "a file\n"


def test_output_dir_on_a_missing_mount(capfd, recipe, no_build):
    """/proc takes no new folders: as a mount point that is not there (for root too)."""
    fails(capfd, ["train", recipe, "output_dir=/proc/shardtune-no-such-mount/run"], "cannot be created",
          "/proc/shardtune-no-such-mount", "choose another output_dir")


def test_output_dir_read_only(capfd, recipe, tmp_path, no_build):
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        with tmpfs(ro, "1m"):
            (ro / "existing").mkdir()
            subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
            fails(capfd, ["train", recipe, f"output_dir={ro / 'new'}"], "cannot be created", "Read-only file system")
            fails(capfd, ["train", recipe, f"output_dir={ro / 'existing'}"], "not writable", "Read-only file system")
    else:  # without root, no mount: a folder without write permission
        (ro / "existing").mkdir(parents=True)
        ro.chmod(0o555)
        (ro / "existing").chmod(0o555)
        try:
            fails(capfd, ["train", recipe, f"output_dir={ro / 'new'}"], "cannot be created", "Permission denied")
            fails(capfd, ["train", recipe, f"output_dir={ro / 'existing'}"], "not writable", "Permission denied")
        finally:
            (ro / "existing").chmod(0o755)
            ro.chmod(0o755)


def test_lock_is_exclusive_and_released(tmp_path):
    """In one process the hold is re-entrant; a fresh folder made for a run that wrote nothing goes again."""
    out = tmp_path / "new" / "run"
    hold_run_dir(out)
    assert "pid " in (out / LOCK_FILE).read_text()
    hold_run_dir(out)
    release_run_dir(out)
    assert not (tmp_path / "new").exists()


def test_lock_of_a_killed_run_and_the_launchers_ranks(monkeypatch, tmp_path):
    """A lock file left by a kill -9 (its flock gone with the process) is taken over, its holder
    line rewritten; a rank whose launcher (its parent, named in LAUNCHER_ENV) holds the folder
    shares the hold and leaves the launcher's file alone; any other process is refused by name."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("pid 4242 on node7 since 2026-01-01 00:00:00\n")
    hold_run_dir(out)
    line = (out / LOCK_FILE).read_text()
    assert line.startswith(f"pid {os.getpid()} on ") and "4242" not in line
    rank = ("import sys\nfrom shardtune.checkpoint.rundir import hold_run_dir, release_run_dir\n"
            "from shardtune.errors import UserError\n"
            f"try:\n    hold_run_dir({str(out)!r})\nexcept UserError as exc:\n    sys.exit(str(exc))\n"
            f"release_run_dir({str(out)!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        shared = subprocess.run([sys.executable, "-c", rank], env={**env, LAUNCHER_ENV: str(os.getpid())},
                                capture_output=True, text=True, timeout=60)
        assert shared.returncode == 0, shared.stderr
        assert (out / LOCK_FILE).read_text() == line
        other = subprocess.run([sys.executable, "-c", rank], env={**env, LAUNCHER_ENV: "1"},
                               capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and f"in use by a live run ({line.strip()})" in other.stderr, other.stderr
    finally:
        release_run_dir(out)
    assert not (out / LOCK_FILE).exists() and out.is_dir()


def test_live_run_refused_by_name(capfd, recipe, tmp_path):
    """Another process holds the folder: a run (here with resume=auto, which would otherwise be
    the advice) is refused naming it, and the folder is left as it was."""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(out / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'pid 4242 on node7 since 2026-01-01 00:00:00')\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(out)
        line = fails(capfd, ["train", recipe, "resume=auto", f"output_dir={out}"],
                     "in use by a live run (pid 4242 on node7 since 2026-01-01 00:00:00)", "choose another output_dir")
        assert "resume=auto" not in line.split(";", 1)[1]
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


# ----------------------------------------------------------------------------- Ctrl-C, one process


def interrupt_at(monkeypatch, step: int, times: int) -> None:
    """Ctrl-C `times` times while optimizer step `step` runs."""
    import shardtune.train.trainer as train_mod

    real, calls = train_mod.train_step, []

    def step_then_sigint(*args, **kw):
        calls.append(1)
        if len(calls) == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(train_mod, "train_step", step_then_sigint)


@pytest.fixture(params=["handled", "ignored"])
def sigint(request):
    """Run the test as from a terminal (Python's KeyboardInterrupt handler) and as under `nohup`
    or `&` (SIGINT ignored, which a run keeps: rank/preemption.py), whatever pytest started with."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if request.param == "ignored" else signal.default_int_handler)
    yield request.param
    signal.signal(signal.SIGINT, before)


def assert_ignored_ctrl_c_trains_to_the_end(rc: int, err: str, out: Path) -> None:
    assert rc == 0, err
    assert "Ctrl-C" not in err and not (out / "PREEMPTED").exists()
    assert (out / "final" / "config.json").is_file()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_ctrl_c_once_checkpoints(capfd, monkeypatch, recipe, tmp_path, sigint):
    interrupt_at(monkeypatch, 2, times=1)
    out = tmp_path / "run"
    rc, stdout, err = run_main(capfd, ["train", recipe, "train.max_steps=5", f"output_dir={out}"])
    if sigint == "ignored":
        return assert_ignored_ctrl_c_trains_to_the_end(rc, err, out)
    assert rc == EXIT_PREEMPTED, err
    assert "Ctrl-C: finishing the steps under way and saving a checkpoint" in err
    # during step 2: the ranks agree on it with step 2's numbers, read once step 3 is queued
    assert f"got SIGINT; checkpoint saved to {out / 'checkpoints' / 'step-000003'}" in stdout
    assert read_meta(out / "checkpoints" / "step-000003")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not (out / LOCK_FILE).exists()


def test_ctrl_c_twice_stops_at_once(capfd, monkeypatch, recipe, tmp_path, sigint):
    interrupt_at(monkeypatch, 3, times=2)
    out = tmp_path / "run"
    rc, _, err = run_main(capfd, ["train", recipe, "train.max_steps=5", "checkpoint.every_steps=1",
                                  f"output_dir={out}"])
    if sigint == "ignored":
        return assert_ignored_ctrl_c_trains_to_the_end(rc, err, out)
    assert rc == EXIT_INTERRUPTED
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last == (f"interrupted (Ctrl-C): stopped at once, without a checkpoint; the last good checkpoint is "
                    f"{out / 'checkpoints' / 'step-000002'} (resume=auto continues from it)")
    assert find_latest(out / "checkpoints").name == "step-000002"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_set_up(capfd, monkeypatch, recipe, tmp_path):
    import shardtune.train.trainer

    def build(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(shardtune.train.trainer, "build_model", build)
    rc, _, err = run_main(capfd, ["train", recipe, f"output_dir={tmp_path / 'run'}"])
    assert rc == EXIT_INTERRUPTED
    assert err.strip() == "interrupted (Ctrl-C): stopped at once, without a checkpoint; this run has no checkpoint"
    assert not (tmp_path / "run").exists()  # made for the run, left empty: removed again


# ----------------------------------------------------------------------------- full disk


def test_space_warning(monkeypatch, tmp_path):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 25 * 10**6))
    cfg = CheckpointConfig(every_steps=10, keep_last=2)
    note = space_warning(tmp_path / "checkpoints", cfg, 10 * 10**6, total_steps=100, steps_per_epoch=50)
    assert "25.0 MB free" in note and "the 3 checkpoint(s) of about 10.0 MB" in note and "keep_last=2" in note
    assert space_warning(tmp_path, CheckpointConfig(every_steps=50, keep_last=0), 10 * 10**6, 100, 50) is None


def test_disk_full_while_the_data_is_cached(capfd, monkeypatch, recipe, qs_assets, tmp_path):
    """`datasets` writes its tokenized cache on a disk with no room left: one line naming the
    disk-full failure, the file and the fix, not the library's traceback; the run folder the
    user kept a file in is untouched."""
    import datasets

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    data = tmp_path / "corpus.jsonl"  # fresh data: nothing of it is cached yet
    data.write_text(Path(qs_assets["train"]).read_text())
    with tmpfs(tmp_path / "cache", "64k") as cache:
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
        line = fails(capfd, ["train", recipe, f"data.path={data}", f"output_dir={out}"],
                     "disk full", "HF_DATASETS_CACHE")
    assert str(tmp_path / "cache") in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    # past loading: the tokenized rows or the packed blocks find no room
    import errno

    import shardtune.data.pipeline as data_mod

    def no_space(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", "cache-00001.arrow")

    monkeypatch.setattr(data_mod, "tokenize_split", no_space)
    fails(capfd, ["train", recipe, f"output_dir={out}"], "disk full while caching the data", "HF_DATASETS_CACHE")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_disk_full_while_writing_a_report(capfd, tmp_path):
    """Any command that fills the disk (here `report`'s PNGs) ends in one line naming the file."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5 / s, "tokens_per_s": 1000.0} for s in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with tmpfs(tmp_path / "small", "16k") as small:
        line = fails(capfd, ["report", str(run), "--out", str(small / "report")], "disk full while writing",
                     str(small / "report"), "free space")
    assert "Traceback" not in line


@pytest.mark.parametrize("how", ["tmpfs", "tmpfs-async", "file-size-limit"])
def test_disk_full_during_save(capfd, monkeypatch, recipe, tmp_path, how):
    """The disk fills after the step-1 checkpoint: the step-2 save fails as one line naming the
    folder and the size needed; its partial folder is gone and `latest` still names step 1.
    Async: step 1 is still being written (it commits after step 2 at the earliest), so it is the
    one that fails, and the line says no checkpoint was written."""
    import shardtune.train.trainer as train_mod

    out, real, calls = tmp_path / "disk" / "run", train_mod.train_step, []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def fill_after_first(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            if how.startswith("tmpfs"):
                free = shutil.disk_usage(out).free
                (out / "filler").write_bytes(b"\0" * max(0, free - 64 * 1024))
            else:  # writes beyond 64 kB fail with EFBIG (Python ignores SIGXFSZ)
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
        return real(*args, **kw)

    monkeypatch.setattr(train_mod, "train_step", fill_after_first)
    failing = "step-000001" if how.endswith("async") else "step-000002"
    with tmpfs(tmp_path / "disk", "8m") if how.startswith("tmpfs") else contextlib.nullcontext():
        try:
            line = fails(capfd, ["train", recipe, "train.max_steps=4", "checkpoint.every_steps=1",
                                 f"checkpoint.async={how.endswith('async')}", f"output_dir={out}"],
                         f"while saving {failing}", str(out / "checkpoints"), "a checkpoint needs about", "MB")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        root = out / "checkpoints"
        assert line.startswith("error: disk full" if how.startswith("tmpfs") else "error: file size limit reached")
        assert not list(root.glob(".tmp-*")) and not list(root.glob(".*.tmp"))
        if how.endswith("async"):
            assert "no checkpoint was written" in line and find_latest(root) is None
            return
        assert f"the last good checkpoint is {root / 'step-000001'}" in line
        assert (root / "latest").read_text().strip() == "step-000001"
        assert read_meta(root / "step-000001")["step"] == 1
