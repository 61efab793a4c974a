"""Bad input: one `error: ...` line naming the problem and the fix, exit code 2, no traceback,
and nothing already in the output folder destroyed.

Most cases call `shardtune.cli.main.main` in-process (importing transformers once per process is
the expensive part); a few run `python -m shardtune` as a real process, including one that
fails inside the workers of `--nproc 2`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from conftest import AGENT_VARS, child_env
from shardtune.cli.main import main
from shardtune.distributed.process_group import check_nproc
from shardtune.errors import EXIT_INTERRUPTED, EXIT_USAGE, UserError

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def qs_assets(assets):
    """{"train": jsonl, "validation": jsonl, "tokenizer": folder} of a small local corpus: conftest's
    (the same build), made once per test process."""
    return assets


@pytest.fixture(scope="session")
def datasets_cache(tmp_path_factory):
    """A private `datasets` cache, so the many tiny test files do not land in ~/.cache."""
    return tmp_path_factory.mktemp("hf-datasets")


@pytest.fixture(scope="session")
def recipe(qs_assets, tmp_path_factory) -> str:
    """A complete tiny run (1-layer GPT-2, seq_len 32, one step): every case overrides one thing.
    A recipe, not the quickstart defaults, so no test builds the full quickstart assets."""
    tree = {
        "model": {"tokenizer": qs_assets["tokenizer"], "config": dict(TINY_GPT2)},
        "data": {"path": qs_assets["train"], "seq_len": 32},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 1, "lr": 1e-3},
        "eval": {"max_batches": 1},
        "log": {"progress": False, "every_steps": 1},
    }
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return str(path)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch, datasets_cache):
    """Run in a scratch folder as a lone process; leave no process group behind.

    The in-process runs make a single-rank group; a UserError in the middle of set-up (after
    the group exists, before Trainer.close) would leave it initialised for the next test."""
    import datasets

    monkeypatch.chdir(tmp_path)
    for name in AGENT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def out(tmp_path) -> Path:
    """An output folder the user already keeps a file in (but no run)."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine, keep me\n")
    return folder


def snapshot(folder: Path) -> dict:
    """Every file under folder: relative path -> (bytes, mtime_ns)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    (line,) = lines
    assert line.startswith("error: "), line
    assert "Traceback" not in err
    return line


@contextlib.contextmanager
def library_logs_to_stderr():
    """The libraries' log handlers hold the stderr of the moment they were made; point them at
    today's (captured) one, so a stray log line next to the error is seen as in a real run."""
    handlers = [h for name in ("datasets", "transformers") for h in logging.getLogger(name).handlers
                if type(h) is logging.StreamHandler]
    saved = [h.stream for h in handlers]
    for h in handlers:
        point(h, sys.stderr)
    try:
        yield
    finally:
        for h, stream in zip(handlers, saved, strict=True):
            point(h, stream)


def point(handler: logging.StreamHandler, stream) -> None:
    """setStream, except that a stream an earlier test's capture has closed is not flushed (a
    handler made while any test captured stderr holds such a stream). Its wrapper does not always
    say so (`closed` False over a closed file): the flush that fails says it."""
    if not getattr(handler.stream, "closed", False):
        try:
            handler.setStream(stream)
            return
        except ValueError:  # "I/O operation on closed file"
            pass
    handler.stream = stream


def fails(capfd, argv: list[str], *words: str) -> str:
    """Run `shardtune <argv>` in-process; assert exit 2 and one `error:` line holding `words`."""
    with library_logs_to_stderr():
        rc = main(argv)
    captured = capfd.readouterr()
    assert rc == EXIT_USAGE, f"rc={rc}\nstdout:\n{captured.out}\nstderr:\n{captured.err}"
    line = one_error_line(captured.err)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    return line


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def subprocess_env(datasets_cache) -> dict:
    return child_env(HF_DATASETS_CACHE=str(datasets_cache))


# ----------------------------------------------------------------------------- config values


@pytest.mark.parametrize("override, words", [
    ("train.lrr=1", ["train.lrr", "did you mean train.lr?"]),
    ("trian.lr=1", ["'trian'", "did you mean train?"]),
    ("fsdp.shardng=no_shard", ["fsdp.shardng", "fsdp.sharding"]),
    ("data.seqlen=64", ["data.seqlen", "data.seq_len"]),
    ("train.lr=abc", ["train.lr", "must be a number", "abc"]),
    ("train.max_steps=1.5", ["train.max_steps", "must be an integer", "1.5"]),
    ("train.betas=0.9", ["train.betas", "must be a list", "train.betas=[0.9,0.95]"]),
    ("log.trackers=tensorboard", ["log.trackers", "must be a list", "log.trackers=[tensorboard]"]),
    ("log.progress=maybe", ["log.progress", "true or false"]),
    ("model.config=5", ["model.config", "mapping"]),
    ("fsdp.sharding=ful_shard", ["fsdp.sharding", "did you mean full_shard?", "choose one of"]),
    ("precision=fp8", ["precision", "bf16, fp16, fp32"]),
    ("device=tpu", ["device", "auto, cpu, cuda"]),
    ("train.global_batch_size=5", ["train.global_batch_size=5", "train.micro_batch_size=2", "divide"]),
    ("train.micro_batch_size=0", ["train.micro_batch_size", "at least 1"]),
    ("log.profile_steps=3", ["log.profile_steps", "must be a list", "log.profile_steps=[3,5]"]),
    ("log.profile_steps=[5,3]", ["log.profile_steps=[5, 3]", "1 <= first <= last", "log.profile_steps=[3,5]"]),
    ("log.profile_steps=[0,2]", ["log.profile_steps=0", "at least 1"]),
    ("train.optimizer_state=fp8", ["train.optimizer_state", "fp32, bf16, 8bit, 4bit"]),
    ("activation_checkpointing=partial", ["activation_checkpointing", "none, full, selective, every_n"]),
    ("activation_checkpointing_every=0", ["activation_checkpointing_every", "at least 1"]),
    ("fsdp.reduce_dtype=bf16", ["fsdp.reduce_dtype=bf16 needs precision=bf16"]),
])
def test_bad_config_value(capfd, recipe, out, override, words):
    before = snapshot(out)
    fails(capfd, ["train", recipe, override, f"output_dir={out}"], *words)
    assert snapshot(out) == before


def test_unknown_key_without_recipe(capfd, monkeypatch, qs_assets, out):
    """No recipe: the first override is not taken for a recipe, and the quickstart defaults
    (on the small assets here, so no full asset build) get the same checks."""
    import shardtune.data.quickstart

    monkeypatch.setattr(shardtune.data.quickstart, "build_quickstart_assets", lambda *a, **k: qs_assets)
    fails(capfd, ["train", "train.lrr=1", f"output_dir={out}"], "train.lrr", "train.lr")
    fails(capfd, ["train", "--nproc", "2", "eval.every=5"], "eval.every", "eval.every_steps")


# ----------------------------------------------------------------------------- recipe and overrides


def test_missing_recipe(capfd, out):
    fails(capfd, ["train", "no_such_recipe.yaml", f"output_dir={out}"], "no_such_recipe.yaml", "not found")


def test_invalid_yaml_recipe(capfd, tmp_path, out):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1e-3, 2\n  max_steps: 5\n")
    fails(capfd, ["train", str(bad), f"output_dir={out}"], "bad.yaml", "not valid YAML", "fix the file")


def test_recipe_not_a_mapping(capfd, tmp_path, out):
    listed = tmp_path / "list.yaml"
    listed.write_text("- train.lr: 1\n- data.seq_len: 8\n")
    fails(capfd, ["train", str(listed), f"output_dir={out}"], "list.yaml", "must be a mapping")


@pytest.mark.parametrize("words", [
    ["oops"],                   # a bare word after the recipe
    ["train.lr"],               # a key with no value
    ["--nproc", "2", "oops"],   # a bare word after an option lands among argparse's extras
    ["--overwrite", "train.lr"],
])
def test_override_not_key_value(capfd, recipe, out, words):
    bad = [w for w in words if not w.startswith("-") and w != "2"][0]
    line = fails(capfd, ["train", recipe, *words, f"output_dir={out}"], f"override {bad!r}",
                 "not key=value", "train.lr=3e-5")
    assert line.count("error:") == 1


def test_override_with_empty_key(capfd, recipe, out):
    fails(capfd, ["train", recipe, "=3", f"output_dir={out}"], "'=3'", "not key=value")


def test_a_long_first_override_is_an_override_not_a_path():
    """Without a recipe the first override sits where the recipe goes; one longer than a file name
    may be (a model.config of a few KB inline) was taken for a path that could not be written."""
    import json

    from shardtune.cli.common import split_recipe

    long = "model.config=" + json.dumps({"model_type": "gpt2", "id2label": {str(i): f"L{i}" for i in range(200)}})
    assert len(long) > 1000 and split_recipe(long, ["train.lr=1"]) == (None, [long, "train.lr=1"])


# ----------------------------------------------------------------------------- processes and devices


def test_nproc_above_gpus_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"--nproc 2 .*1 CUDA GPU.*use --nproc 1 or fewer"):
        check_nproc(2, "auto")
    with pytest.raises(UserError, match=r"--nproc 4 .*1 CUDA GPU"):
        check_nproc(4, "cuda")
    check_nproc(1, "auto")
    check_nproc(4, "cpu")  # CPU ranks are not limited by the GPUs


def test_nproc_above_gpus_cli(capfd, monkeypatch, recipe, out):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = snapshot(out)
    fails(capfd, ["train", recipe, "--nproc", "2", f"output_dir={out}"], "--nproc 2", "1 CUDA GPU", "--nproc 1")
    assert snapshot(out) == before


def test_nproc_not_positive(capfd, recipe, out):
    fails(capfd, ["train", recipe, "--nproc", "0", f"output_dir={out}"], "--nproc", "at least 1")
    fails(capfd, ["train", recipe, "--nproc", "-2", f"output_dir={out}"], "--nproc", "at least 1")


@pytest.mark.parametrize("nproc", [["--nproc", "2"], []])
def test_ctrl_c_while_the_run_is_checked_says_so(capfd, monkeypatch, recipe, out, nproc):
    """Ctrl-C while the run is checked (the tokenizer, the model's config), before any rank or
    training started: exit 130 with the one line every Ctrl-C stop has, not a silent 130; the
    output folder's hold is let go."""
    import shardtune.check.run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shardtune.check.run, "check_run", interrupted)
    before = snapshot(out)
    assert main(["train", recipe, f"output_dir={out}", *nproc]) == EXIT_INTERRUPTED
    err = capfd.readouterr().err
    assert err.startswith("interrupted (Ctrl-C)") and err.count("\n") == 1 and "no checkpoint" in err, err
    assert snapshot(out) == before  # the lock let go with the launcher's hold


def test_cuda_requested_without_gpu(capfd, monkeypatch, recipe, out):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(UserError, match="no CUDA GPU"):
        check_nproc(2, "cuda")
    fails(capfd, ["train", recipe, "device=cuda", f"output_dir={out}"], "device=cuda", "device=cpu")
    fails(capfd, ["train", recipe, "device=cuda", "--nproc", "2", f"output_dir={out}"], "device=cuda", "device=cpu")


# ----------------------------------------------------------------------------- output folder


def _plant_run(folder: Path, checkpoints: bool = False) -> None:
    (folder / "config.yaml").write_text("old: run\n")
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n')
    (folder / "final").mkdir()
    (folder / "final" / "model.safetensors").write_bytes(b"\x00old weights")
    if checkpoints:
        (folder / "checkpoints" / "step-1").mkdir(parents=True)
        (folder / "checkpoints" / "step-1" / "state.pt").write_bytes(b"old state")


def test_output_dir_holding_a_run(capfd, recipe, out):
    _plant_run(out)
    before = snapshot(out)
    refusal = ["already holds a run", "--overwrite", str(out)]
    fails(capfd, ["train", recipe, f"output_dir={out}"], *refusal)
    assert snapshot(out) == before
    # the parent of --nproc N refuses before starting any worker
    fails(capfd, ["train", recipe, "--nproc", "2", f"output_dir={out}"], *refusal)
    assert snapshot(out) == before
    # a bad input together with the refusal still leaves everything as it was
    fails(capfd, ["train", recipe, "data.seq_len=128", f"output_dir={out}"])
    assert snapshot(out) == before
    # and so does one found after the folder's check: --overwrite replaces the run once all input is read
    fails(capfd, ["train", recipe, f"data.path={out / 'final' / 'data.jsonl'}", f"output_dir={out}", "--overwrite"],
          "not found")
    assert snapshot(out) == before

    # --overwrite replaces the run, and only the run
    rc = main(["train", recipe, "device=cpu", f"output_dir={out}", "--overwrite"])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert "Traceback" not in captured.err
    assert (out / "notes.txt").read_bytes() == before["notes.txt"][0]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert "old" not in config and config["data"]["seq_len"] == 32
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 1, "loss": 9.9} not in records  # the planted record (a substring test met "1069.9" tokens/s)
    assert (out / "final").is_dir() and (out / "final" / "model.safetensors").read_bytes() != b"\x00old weights"


def test_output_dir_holding_checkpoints(capfd, recipe, out):
    _plant_run(out, checkpoints=True)
    before = snapshot(out)
    fails(capfd, ["train", recipe, f"output_dir={out}"], str(out), "checkpoints", "--overwrite")
    fails(capfd, ["train", recipe, "--nproc", "2", f"output_dir={out}"], str(out), "--overwrite")
    assert snapshot(out) == before


def test_output_dir_is_a_file(capfd, recipe, tmp_path):
    target = tmp_path / "taken"
    target.write_text("a file, not a folder\n")
    fails(capfd, ["train", recipe, f"output_dir={target}"], "is a file", "output_dir")
    assert target.read_text() == "a file, not a folder\n"


@pytest.mark.parametrize("argv", [
    ["train", "{recipe}", "output_dir={link}"],
    ["report", "{run}", "--out", "{link}"],
    ["sweep", "{recipe}", "--grid", "train.lr=1e-3,2e-3", "--out", "{link}"],
], ids=["train", "report", "sweep"])
def test_an_output_folder_that_is_a_link_to_nothing_is_refused_by_every_command(capfd, recipe, tmp_path, argv):
    """One rule: a link that leads nowhere is refused, naming it (report and sweep said 'is a file';
    train followed it and created whatever it named, wherever that was). Export: test_model_inputs."""
    link, target, run = tmp_path / "out", tmp_path / "gone" / "deeper", tmp_path / "run"
    link.symlink_to(target)
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in (1, 2)))
    fails(capfd, [a.format(recipe=recipe, link=link, run=run) for a in argv],
          f"{str(link)!r} is a link to {str(target)!r}, which does not exist", "create that folder, or choose another")
    assert not target.parent.exists() and link.is_symlink()


# ----------------------------------------------------------------------------- real processes


def test_help_lists_config_keys():
    for argv in (["--help"], ["train", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "shardtune", *argv], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        for key in ("fsdp.sharding", "train.global_batch_size", "data.seq_len", "output_dir"):
            assert key in proc.stdout, (argv, key)
    assert "--overwrite" in proc.stdout and "--nproc" in proc.stdout


def test_config_error_is_fast_and_lazy(recipe, datasets_cache):
    """A config error (and --help) is reported without importing torch or transformers."""
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from shardtune.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                main(["train", "--help"])
            except SystemExit:
                pass
        rc = main(["train", {recipe!r}, "train.lrr=1"])
        print(rc, "torch" in sys.modules, "transformers" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(datasets_cache))
    assert proc.stdout.split() == ["2", "False", "False"], proc.stdout + proc.stderr
    one_error_line(proc.stderr)


def test_subprocess_config_error(recipe, tmp_path, datasets_cache):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", recipe, "train.lrr=1",
                           f"output_dir={out}"], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(datasets_cache))
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert "train.lrr" in line and "did you mean train.lr?" in line
    assert proc.stdout == ""
    assert not out.exists()


@pytest.mark.multiproc
def test_subprocess_nproc2_worker_error(recipe, tmp_path, datasets_cache):
    """global 2 divides by micro 2 (the parent's check passes) but not by micro x 2 ranks: the
    workers fail, rank 0 prints the one line, and the launcher adds nothing."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine, keep me\n")
    before = snapshot(out)
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", recipe, "train.global_batch_size=2",
                           "device=cpu", f"output_dir={out}", "--nproc", "2"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=subprocess_env(datasets_cache))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert "train.global_batch_size=2" in line and "2 x 2" in line and "number of ranks" in line
    assert "Traceback" not in proc.stdout
    assert snapshot(out) == before
