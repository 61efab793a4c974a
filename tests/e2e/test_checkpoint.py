"""Checkpoints: sharded save, exact resume (same world size, 2 -> 1, 1 -> 2, mid-epoch, with
gradient accumulation), atomic saves under kill -9, preemption by signal, NaN handling, and
one-line errors for bad checkpoints and output-folder conflicts.

One-rank runs happen in this process (shardtune.train.trainer.Trainer / cli.main); only the 2-rank
runs and the kill -9 run are separate processes, to keep the suite fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import child_env
from shardtune.checkpoint.folders import check_compatible, find_latest, read_meta
from shardtune.cli.main import main
from shardtune.errors import EXIT_PREEMPTED, UserError

ROOT = Path(__file__).resolve().parents[2]
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
STEPS = 10
EXACT, ELASTIC = 1e-6, 1e-5


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def ck_assets(assets):
    """Corpus + tokenizer (also test_eval_generate's): conftest's, built once per test process."""
    return assets


@pytest.fixture(autouse=True)
def one_thread(single_thread):
    yield
    release_group()


def release_group() -> None:
    """A run that fails in-process leaves its world-1 group behind; later runs need a fresh one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


BASE = {  # 10 steps, 4 per epoch (data.end_idx=12), accumulation 4 on one rank
    "model": {"config": GPT2}, "device": "cpu",
    "data": {"seq_len": 64, "end_idx": 12},
    "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": STEPS, "lr": 1e-3, "warmup_steps": 2},
    "eval": {"max_batches": 2}, "log": {"every_steps": 1, "progress": False},
}


def overrides(assets: dict, out: Path, **extra) -> list[str]:
    """A recipe (not the CLI's quickstart defaults) plus the output folder and `extra` overrides."""
    import yaml

    recipe = Path(assets["tokenizer"]).parent.parent / "ckpt-recipe.yaml"
    if not recipe.exists():
        tree = json.loads(json.dumps(BASE))
        tree["model"]["tokenizer"] = assets["tokenizer"]
        tree["data"]["path"] = str(Path(assets["train"]).parent)
        recipe.write_text(yaml.safe_dump(tree))
    return [str(recipe), *(f"{k}={v}" for k, v in {"output_dir": str(out), **extra}.items())]


def config(assets: dict, out: Path, **extra):
    from shardtune.config.load import load_config

    recipe, *rest = overrides(assets, out, **extra)
    return load_config(recipe, rest)


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def assert_same(got: dict, ref: dict, tol: float) -> None:
    assert got, "no losses logged"
    worst = max(abs(got[s] - ref[s]) for s in got)
    assert worst <= tol, f"max loss difference {worst:.3g} > {tol:g}: {got} vs {ref}"


def cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    release_group()
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def spawn(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="module")
def reference(ck_assets, tmp_path_factory):
    """The uninterrupted run every resume is compared with. It saves asynchronously every 3 steps
    and at each epoch end (steps 3, 4, 6, 8, 9) and keeps the last 3."""
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("reference")
    torch.set_num_threads(1)
    run(config(ck_assets, out, **{
        "checkpoint.every_steps": 3, "checkpoint.at_epoch_end": "true", "checkpoint.keep_last": 3,
        "checkpoint.async": "true"}))
    release_group()
    return out


# ----------------------------------------------------------------------------- layout and metadata


def test_layout_keep_last_and_metadata(reference):
    root = reference / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step-000006", "step-000008", "step-000009"], names
    assert (root / "latest").read_text().strip() == "step-000009"
    assert find_latest(root) == root / "step-000009"
    step6 = root / "step-000006"
    meta = read_meta(step6)
    assert meta["step"] == 6 and meta["world_size"] == 1 and meta["epoch"] == 1.5
    assert meta["data"] == {"start_idx": None, "end_idx": 12, "epoch": 1, "samples_into_epoch": 16,
                            "samples_consumed": 48, "sequences_per_epoch": meta["data"]["sequences_per_epoch"],
                            "next_batch": meta["data"]["next_batch"]}
    assert meta["train_state"]["tokens_seen"] == 6 * 8 * 64
    assert meta["config"]["train"]["max_steps"] == STEPS and meta["train_state"]["step"] == 6
    assert (step6 / ".metadata").is_file() and (step6 / "rng-rank00000.pt").is_file()
    assert (step6 / "config.json").is_file() and (step6 / "tokenizer").is_dir()
    assert not list(root.glob(".tmp-*"))


# ----------------------------------------------------------------------------- exact resume


def test_resume_path_mid_epoch_exact(reference, ck_assets, tmp_path):
    """Resume the async-written step-6 checkpoint (mid-epoch 1, accumulation 4) into a new folder."""
    from shardtune.train.trainer import run

    ckpt = reference / "checkpoints" / "step-000006"
    run(config(ck_assets, tmp_path, resume=str(ckpt)))
    got = losses(tmp_path)
    assert sorted(got) == list(range(7, STEPS + 1))
    assert_same(got, losses(reference), EXACT)


def test_signal_stop_then_resume_auto_exact(reference, ck_assets, tmp_path, capsys, monkeypatch):
    """SIGUSR1 during step 5 (mid-epoch): the ranks agree on it with step 5's numbers, which the
    host reads once step 6 is queued, so the checkpoint is step 6's; exit 75. The same command
    with resume=auto finishes the run with the uninterrupted losses. Without resume the folder
    is refused."""
    import shardtune.train.trainer as train_mod

    real_step, calls = train_mod.train_step, []

    def step_then_signal(*args, **kw):
        result = real_step(*args, **kw)
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGUSR1)
        return result

    monkeypatch.setattr(train_mod, "train_step", step_then_signal)
    args = ["train", *overrides(ck_assets, tmp_path)]
    code, _ = cli(args, capsys)
    assert code == EXIT_PREEMPTED
    assert read_meta(tmp_path / "checkpoints" / "step-000006")["step"] == 6
    assert not (tmp_path / "final").exists()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handler removed after the run
    monkeypatch.setattr(train_mod, "train_step", real_step)

    one_line_error(*cli(args, capsys), "resume=auto", "--overwrite")
    code, _ = cli([*args, "resume=auto"], capsys)
    assert code == 0 and (tmp_path / "final" / "config.json").is_file()
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))  # steps 1-6 kept, 7-10 from the resumed run
    assert_same(got, losses(reference), EXACT)


def test_kill9_mid_first_save_then_resume_starts(reference, ck_assets, tmp_path):
    """A process killed while writing its first checkpoint (step 3) leaves no usable one; a requeue
    with resume=auto still starts: from step 0, the killed attempt's files kept in
    earlier-attempt-1 (the half-written save among them), and it matches the uninterrupted run.
    That a later kill resumes from the newest whole checkpoint: test_latest_gone_falls_back_..."""
    from shardtune.train.trainer import run

    script = (
        "import os, signal, sys\n"
        "import shardtune.checkpoint.dcp as c\n"
        "real = c.write_text_atomic\n"
        "def killed(path, text, sync=False):\n"
        "    if path.name == 'meta.json' and '000003' in str(path):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)  # shards written, not yet committed\n"
        "    real(path, text, sync)\n"
        "c.write_text_atomic = killed\n"
        "from shardtune.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = spawn(["-c", script, "train", *overrides(ck_assets, tmp_path, **{"checkpoint.every_steps": 3})])
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, output
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step-000003" / ".metadata").is_file() and find_latest(root) is None
    with pytest.raises(UserError, match="not a complete shardtune checkpoint"):
        read_meta(root / ".tmp-step-000003")
    killed_metrics = (tmp_path / "metrics.jsonl").read_bytes()

    run(config(ck_assets, tmp_path, resume="auto", **{"checkpoint.every_steps": 3}))
    aside = tmp_path / "earlier-attempt-1"
    assert (aside / "checkpoints" / ".tmp-step-000003" / ".metadata").is_file()
    assert (aside / "metrics.jsonl").read_bytes() == killed_metrics
    assert_same(losses(tmp_path), losses(reference), EXACT)


@pytest.mark.multiproc
def test_sigterm_two_ranks_then_resume_on_one(reference, ck_assets, tmp_path):
    """SIGTERM to a 2-rank run: every rank stops at the same step, one checkpoint, exit 75.
    Resumed on 1 rank (elastic 2 -> 1), the losses equal the uninterrupted run."""
    from shardtune.train.trainer import run

    proc = spawn(["-m", "shardtune", "train", "--nproc", "2", *overrides(ck_assets, tmp_path)])
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and '"loss"' in metrics.read_text():
            break  # training has started: the handlers are installed
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, output
    ckpt = find_latest(tmp_path / "checkpoints")
    meta = read_meta(ckpt)
    assert meta["world_size"] == 2 and 1 <= meta["step"] < STEPS, output
    assert sorted(p.name for p in ckpt.glob("rng-rank*")) == ["rng-rank00000.pt", "rng-rank00001.pt"]
    assert not (tmp_path / "final").exists()

    run(config(ck_assets, tmp_path, resume="auto"))
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same(got, losses(reference), ELASTIC)


@pytest.mark.multiproc
def test_one_rank_checkpoint_resumes_on_two(reference, ck_assets, tmp_path):
    """Elastic 1 -> 2: the step-8 checkpoint of the 1-rank run, continued by 2 ranks."""
    proc = spawn(["-m", "shardtune", "train", "--nproc", "2",
                  *overrides(ck_assets, tmp_path, resume=str(reference / "checkpoints" / "step-000008"))])
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    assert "re-seeded" in output  # RNG streams cannot carry over to another world size; it says so
    got = losses(tmp_path)
    assert sorted(got) == [9, 10]
    assert_same(got, losses(reference), ELASTIC)


# ----------------------------------------------------------------------------- NaN / inf


def poison_step(monkeypatch, step: int) -> None:
    """Make every micro-batch loss of optimizer step `step` NaN (4 micro-batches per step)."""
    import shardtune.train.step as train_mod

    real, calls = train_mod.token_loss, []

    def token_loss(model, batch, accuracy=False, **kw):
        s, n, c = real(model, batch, accuracy, **kw)
        if model.training:
            calls.append(1)
        if model.training and (len(calls) - 1) // 4 + 1 == step:
            s = s * float("nan")
        return s, n, c

    monkeypatch.setattr(train_mod, "token_loss", token_loss)


def test_nan_stops_and_keeps_last_good_checkpoint(ck_assets, tmp_path, monkeypatch):
    from shardtune.train.trainer import Trainer

    poison_step(monkeypatch, 4)
    cfg = config(ck_assets, tmp_path, **{"checkpoint.every_steps": 2, "eval.at_start": "false"})
    trainer = Trainer(cfg)
    with pytest.raises(UserError) as err:
        trainer.fit()
    message = str(err.value)
    assert "nan" in message and "step 4" in message and "step-000002" in message and "on_nan=skip" in message
    assert "\n" not in message
    root = tmp_path / "checkpoints"
    assert find_latest(root) == root / "step-000002" and not list(root.glob("*000004"))
    assert all(torch.isfinite(p.full_tensor()).all() for p in trainer.model.parameters())  # never applied
    trainer.close()


def test_nan_skip_goes_on(ck_assets, tmp_path, monkeypatch):
    from shardtune.train.trainer import run

    poison_step(monkeypatch, 4)
    run(config(ck_assets, tmp_path, on_nan="skip", **{"train.max_steps": 6, "eval.at_start": "false"}))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("skipped")] == [4]
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in rows if r["step"] in (5, 6))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- bad input


def test_bad_checkpoints_and_conflicts(reference, ck_assets, tmp_path, capsys):
    args = ["train", *overrides(ck_assets, tmp_path / "run")]
    one_line_error(*cli([*args, f"resume={tmp_path / 'missing'}"], capsys), "not found")
    one_line_error(*cli([*args, "resume=auto", "--overwrite"], capsys), "--overwrite")

    broken = tmp_path / "broken"
    shutil.copytree(reference / "checkpoints" / "step-000009", broken)
    shard = next(broken.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    one_line_error(*cli([*args, f"resume={broken}"], capsys), "could not be loaded")
    (broken / "meta.json").write_text("{not json")
    one_line_error(*cli([*args, f"resume={broken}"], capsys), "corrupt")
    (broken / "meta.json").unlink()
    one_line_error(*cli([*args, f"resume={broken}"], capsys), "not a complete shardtune checkpoint")

    good = str(reference / "checkpoints" / "step-000009")
    one_line_error(*cli([*args, f"resume={good}", "data.seq_len=32"], capsys), "data.seq_len", "64 -> 32")
    bigger = json.dumps({**GPT2, "n_embd": 128})
    one_line_error(*cli([*args, f"resume={good}", f"model.config={bigger}"], capsys), "model.config")
    # the same config reading other files (edited, re-downloaded, tokenized otherwise): it resumed on them
    edited = tmp_path / "edited"
    shutil.copytree(good, edited)
    meta = json.loads((edited / "meta.json").read_text())
    meta["data"]["sequences_per_epoch"] += 5
    (edited / "meta.json").write_text(json.dumps(meta))
    one_line_error(*cli([*args, f"resume={edited}"], capsys), "training split now holds", "restore that data")
    one_line_error(*cli(["export", str(tmp_path / "missing"), str(tmp_path / "x")], capsys), "not found")
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was started


def test_a_resume_that_would_train_other_sequences_next_is_refused(reference, ck_assets, tmp_path, capsys,
                                                                     monkeypatch):
    """The same config and the same number of sequences, another order (a shardtune whose batch plan
    shuffles otherwise, as group_by_length's did once; another torch's randperm) or other documents (the
    hold-out drawn otherwise, files edited at equal count): the resume trained the rest of the epoch on
    other samples than the uninterrupted run, some twice, some never, without a word."""
    from shardtune.data.batches import BatchPlan

    real = BatchPlan.order
    monkeypatch.setattr(BatchPlan, "order", lambda plan, epoch: real(plan, epoch).flip(0))
    args = ["train", *overrides(ck_assets, tmp_path), f"resume={reference / 'checkpoints' / 'step-000006'}"]
    one_line_error(*cli(args, capsys), "step 7 would train other sequences", "restore them")
    assert not (tmp_path / "checkpoints").exists()


def test_harmless_changes_are_allowed(reference):
    saved = read_meta(reference / "checkpoints" / "step-000009")["config"]
    now = json.loads(json.dumps(saved))
    now["train"].update(lr=5e-4, max_steps=50, warmup_steps=0)
    now["eval"].update(every_steps=7, max_batches=1)
    now.update(resume="auto", output_dir="elsewhere")
    now["checkpoint"]["every_steps"] = 100
    check_compatible(saved, now, Path("x"))
    now["train"]["global_batch_size"] = 16
    with pytest.raises(UserError, match="train.global_batch_size"):
        check_compatible(saved, now, Path("x"))


def test_keys_added_to_the_config_later_resume_at_their_default(reference):
    """A checkpoint written before data.padding_free existed resumes when the key keeps its
    default, and is refused when it does not."""
    now = read_meta(reference / "checkpoints" / "step-000009")["config"]
    saved = json.loads(json.dumps(now))
    del saved["data"]["padding_free"], saved["data"]["document_mask"]
    check_compatible(saved, now, Path("x"))
    now["data"]["document_mask"] = True
    with pytest.raises(UserError, match="data.document_mask None -> True"):
        check_compatible(saved, now, Path("x"))


def test_async_key_alias():
    from shardtune.config.load import load_config

    base = ["model.config={model_type: gpt2}", "data.path=x"]
    assert load_config(None, [*base, "checkpoint.async=true"]).checkpoint.async_save is True
    assert load_config(None, [*base, "checkpoint.async_save=true"]).checkpoint.async_save is True
