"""Publishing to the Hub from a run, against a real local server speaking the Hub's protocol
(tests/hub_server.py): uploads arrive with the right files, a resume skips what is there, a
server that refuses or hangs leaves training unharmed with one warning, bad input exits 2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hub_server import point_at, start_server

from conftest import tiny_overrides
from shardtune.checkpoint.folders import FINAL_RECORD


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """(store, endpoint) of a local hub that this process talks to; its first commit fails with a
    503 (a passing outage), which `publish.retries` gets over."""
    proc, store, endpoint = start_server(tmp_path, "--fail-first-commit")
    point_at(monkeypatch, endpoint)
    yield store, endpoint
    proc.kill()
    proc.wait()


def commits(store: Path) -> list[dict]:
    path = store / "commits.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_tiny(assets, out, **extra):
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    return run(load_config(None, tiny_overrides(assets, out, **extra), defaults={}), overwrite=False)


PUBLISH = {"publish.hub_repo": "user/tiny", "checkpoint.every_steps": 1, "checkpoint.keep_last": 0,
           "publish.revision": "dev", "eval.max_batches": 1, "eval.at_start": "false", "train.global_batch_size": 4}


def test_checkpoints_final_and_card_uploaded_and_resume_skips_them(assets, tmp_path, hub, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    from shardtune.telemetry.trackers import Trackers

    artifacts = []  # what the trainer hands the trackers (W&B's side: test_wandb_artifacts.py)
    monkeypatch.setattr(Trackers, "artifact", lambda self, folder, step, final: artifacts.append((folder.name, final)))
    store, _ = hub
    out = tmp_path / "run"
    run_tiny(assets, out, **{"train.max_steps": 2, **PUBLISH})
    assert artifacts == [("step-000001", False), ("step-000002", False), ("final", True)]
    repo = store / "user" / "tiny" / "dev"
    first = commits(store)
    assert [c["paths"][0].split("/")[:2] for c in first[:2]] == [["checkpoints", "step-000001"],
                                                                 ["checkpoints", "step-000002"]]
    assert {"README.md", "shardtune_config.yaml", "config.json", "model.safetensors"} <= set(first[2]["paths"])
    card = (repo / "README.md").read_text()
    assert "eval_loss" in card and "2 optimizer steps" in card
    command = next(line.split()[2:] for line in card.splitlines() if line.startswith("shardtune train"))
    from shardtune.config.load import load_config

    again = load_config(str(repo / command[0]), command[1:])  # the card's command reads the uploaded recipe
    assert again.publish.hub_repo is None and again.output_dir == "runs/reproduce"
    assert again.train == load_config(str(out / "config.yaml")).train
    # each uploaded checkpoint is a model that loads, and equals the final one at the same step
    ckpt = AutoModelForCausalLM.from_pretrained(repo / "checkpoints" / "step-000002")
    final = AutoModelForCausalLM.from_pretrained(repo)
    assert all(a.equal(b) for a, b in zip(ckpt.state_dict().values(), final.state_dict().values(), strict=True))
    local = {f.relative_to(out / "final").as_posix(): f.read_bytes() for f in (out / "final").rglob("*") if f.is_file()}
    assert {name: (repo / name).read_bytes() for name in local} == local  # byte for byte, nothing missing
    assert not [p for p in (store / "user" / "tiny" / "main").rglob("*") if p.is_file()]  # all on the branch
    step2 = repo / "checkpoints" / "step-000002"  # a checkpoint's upload has the files of final/ (tokenizer too)
    # ... but final/'s record of its step (checkpoint.folders.FINAL_RECORD), which a checkpoint's folder name tells
    assert {f.relative_to(step2).as_posix() for f in step2.rglob("*") if f.is_file()} == set(local) - {
        "shardtune.json"}, sorted(local)
    printed = capsys.readouterr().out
    assert "publish: 3 uploaded" in printed and "warning: could not upload" not in printed, printed[-2000:]
    assert (store / "failed.jsonl").read_text().count("503") == 1  # step 1's first attempt, retried

    # resumed to 3 steps: only step 3 and the final model go up again
    run_tiny(assets, out, **{"train.max_steps": 3, "resume": "auto", **PUBLISH})
    again = commits(store)[len(first):]
    assert [c["paths"][0].split("/")[1] if c["paths"][0].startswith("checkpoints/") else "final"
            for c in again] == ["step-000003", "final"]
    assert all(not c["deleted"] for c in again)  # the resume removes nothing of the earlier uploads
    assert {p.name for p in (repo / "checkpoints").iterdir()} == {f"step-00000{i}" for i in (1, 2, 3)}
    card = (repo / "README.md").read_text()  # the resumed run's card: its last step and its final eval
    last = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r][-1]
    assert last["step"] == 3 and "3 optimizer steps" in card and f"| eval_loss | {last['eval_loss']:.4f} |" in card
    ledger = json.loads((out / "publish" / "ledger.json").read_text())["user/tiny@dev"]
    assert set(ledger) == {f"checkpoints/step-00000{i}" for i in (1, 2, 3)} | {"final"}


def test_hung_server_leaves_training_unharmed(assets, tmp_path):
    """The first checkpoint's commit never returns: the steps after it run all the same (uploads
    are in the background), and the command's process ends after publish.wait_s, not when the
    hung request would (huggingface_hub's client has no timeout: an executor thread joined at
    exit, as `run_as_future` uses, would keep it alive)."""
    from conftest import losses, run_cli

    proc, store, endpoint = start_server(tmp_path, "--hang-commits")
    try:
        out = tmp_path / "run"
        flags = {"train.max_steps": 3, "publish.wait_s": 1, **PUBLISH}
        t0 = time.monotonic()
        done = run_cli(["train", *tiny_overrides(assets, out, **flags)], timeout=120,
                       env={"HF_ENDPOINT": endpoint, "HF_TOKEN": "test-token", "HF_HUB_OFFLINE": "0"})
        assert done.returncode == 0 and time.monotonic() - t0 < 90, done.stderr[-2000:]
    finally:
        proc.kill()
        proc.wait()
    assert len(losses(out)) == 3 and (out / "final" / "config.json").is_file() and commits(store) == []
    assert "publish: 0 uploaded, 4 still in flight after 1s (publish.wait_s)" in done.stdout


def test_rejected_push_is_one_warning_and_training_goes_on(assets, tmp_path, monkeypatch, capsys):
    """Every commit answered 403 (a full quota): one warning, the run and its files complete."""
    proc, store, endpoint = start_server(tmp_path, "--deny-commits")
    point_at(monkeypatch, endpoint)
    out = tmp_path / "run"
    try:
        run_tiny(assets, out, **{"train.max_steps": 2, "publish.retries": 2, **PUBLISH})
    finally:
        proc.kill()
        proc.wait()
    text = capsys.readouterr().out
    warnings = [line for line in text.splitlines() if line.startswith("warning: could not upload")]
    assert len(warnings) == 1 and "user/tiny" in warnings[0] and "quota" in warnings[0], text[-2000:]
    assert "3 failed" in text
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001", "step-000002"]
    assert (out / "final" / "config.json").is_file() and commits(store) == []


@pytest.mark.parametrize("overrides, message", [
    (["publish.hub_repo=not a repo"], "is not a Hub repo id"),
    (["publish.hub_repo=user/m"], "none are saved; set checkpoint.every_steps"),
    (["publish.hub_repo=user/m", "checkpoint.every_steps=2"], "needs a Hub token"),
    (["publish.wandb_artifacts=upload"], "add log.trackers=[wandb]"),
    (["publish.hub_repo=user/m", "publish.checkpoints=false", "HF_HUB_OFFLINE"], "HF_HUB_OFFLINE is set"),
])
def test_bad_publish_input_is_one_line_before_any_model(assets, tmp_path, monkeypatch, capsys, overrides, message):
    import huggingface_hub.constants as constants

    from shardtune.cli.main import main

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    offline = "HF_HUB_OFFLINE" in overrides  # read once at import, like HF_ENDPOINT
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    if offline:
        monkeypatch.setenv("HF_TOKEN", "test-token")
        overrides = overrides[:-1]
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(assets, out), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (out / "checkpoints").exists()


def test_missing_token_with_required_false_trains_without_publishing(assets, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    run_tiny(assets, tmp_path / "run", **{"train.max_steps": 1, "publish.hub_repo": "user/m",
                                         "publish.checkpoints": "false", "publish.required": "false"})
    lines = [x for x in capsys.readouterr().out.splitlines() if "Hub token" in x]
    assert len(lines) == 1 and "does not publish to user/m" in lines[0]
    assert not (tmp_path / "run" / "publish").exists()


@pytest.mark.parametrize("init", ["default", "pissa"])
def test_lora_adapter_on_the_hub_names_the_bases_hub_id(assets, tmp_path, hub, capsys, init):
    """A local base whose config.json keeps the hub id it came from: the Hub copy of the adapter
    config names that id (it loads from the Hub), the local copy keeps the local path. PiSSA's
    adapter belongs to the residual base: that is uploaded in base/, and the run says so."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from conftest import TINY

    base = tmp_path / "base-folder"
    AutoModelForCausalLM.from_config(GPT2Config(**{k: v for k, v in TINY["gpt2"].items() if k != "model_type"})
                                     ).save_pretrained(base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/tiny-base"}))
    store, _ = hub
    out = tmp_path / "run"
    run_tiny(assets, out, **{**PUBLISH, "train.max_steps": 1, "peft.method": "lora", "peft.init": init,
                             "model.config": "{}", "model.name_or_path": str(base)})
    repo = store / "user" / "tiny" / "dev"
    for folder in (repo, repo / "checkpoints" / "step-000001"):  # the final adapter and a checkpoint's
        named = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert (named == "org/tiny-base") == (init == "default"), named
        assert (folder / "base" / "config.json").is_file()  # a local base is uploaded beside it
    assert Path(json.loads((out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]).exists()
    card = (repo / "README.md").read_text()  # the Hub loads the adapter on the card's base_model
    assert ('base_model: "org/tiny-base"' in card) == (init == "default"), card[:300]
    printed = capsys.readouterr().out
    assert "names a local path" not in printed and ("residual base weights" in printed) == (init == "pissa")
    # `export --push-to-hub` of the same checkpoint names the same base (it named the export's local path)
    from shardtune.cli.main import main

    assert main(["export", str(out / "checkpoints" / "step-000001"), str(tmp_path / "exp"), "--push-to-hub",
                 "user/exp"]) == 0
    pushed = store / "user" / "exp" / "main"
    named = json.loads((pushed / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (named == "org/tiny-base") == (init == "default"), named
    assert all((tmp_path / "exp" / f.relative_to(pushed)).read_bytes() == f.read_bytes()
               for f in pushed.rglob("*") if f.is_file() and f.name != "adapter_config.json")


def test_lora_base_without_a_hub_id_warns_how_to_fix(tmp_path):
    from types import SimpleNamespace

    from shardtune.publish.adapter_base import hub_base

    def model(name, random_init=False):
        return SimpleNamespace(name_or_path=name, random_init=random_init)

    assert hub_base(model("org/tiny-base")) == ("org/tiny-base", None)
    for cfg in (model(str(tmp_path)), model(None, random_init=True)):
        base, warning = hub_base(cfg)
        assert base is None and "set model.name_or_path to the base's hub id" in warning
    assert str(tmp_path) in hub_base(model(str(tmp_path)))[1]


@pytest.mark.parametrize("config, init, base", [
    ({}, "default", "org/tiny-base"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "default", None),  # the hub config gives other logits
    ({}, "pissa", None),  # the residual base, in base/
])
def test_an_adapter_names_the_hub_base_only_where_it_is_the_trained_one(config, init, base):
    from shardtune.config.schema import ModelConfig, PeftConfig
    from shardtune.publish.adapter_base import adapter_hub_base

    named, warning = adapter_hub_base(ModelConfig(name_or_path="org/tiny-base", config=config),
                                      PeftConfig(method="lora", init=init))
    assert named == base and (warning is None) == (base is not None)
    assert base or "load the Hub copy with that subfolder as its base" in warning
    # the card's base_model (what the Hub loads the adapter on) is the same; fine-tuned all the same
    from shardtune.config.schema import RunConfig
    from shardtune.publish.card import model_card

    cfg = RunConfig()
    cfg.model.name_or_path, cfg.model.config, cfg.peft.method, cfg.peft.init = "org/tiny-base", config, "lora", init
    header = model_card(cfg.to_dict(), 3, None).split("\n---\n")[0]
    assert ('base_model: "org/tiny-base"' in header) == (base is not None) and "- fine-tuned" in header, header


NAMES = ["model.safetensors", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors", "model-00001-of-00003.safetensors", "adapter_config.json",
         "adapter_model.safetensors", "tokenizer.json", "tokenizer.model", "config.json", "base/model.safetensors",
         FINAL_RECORD]  # final/'s step: a later export --push-to-hub left {"step": 2} beside step 5's weights


def test_a_push_replaces_the_earlier_model_files_and_keeps_checkpoints_and_text(tmp_path, monkeypatch):
    """A repo whose root (or checkpoints/step-N/) held one upload, pushed a folder with other files (a model in one file
    after one in shards, or the reverse): the root holds exactly the new folder's files, byte for
    byte; a stale model.safetensors beside a newer index made transformers load the earlier
    weights. What the root keeps: checkpoints/ (uploaded on their own), and what is not a model
    folder's file (README.md, a person's images and results)."""
    from huggingface_hub import HfApi
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shardtune.publish.hub import commit_folder, push_folder

    proc, store, endpoint = start_server(tmp_path)
    point_at(monkeypatch, endpoint)
    kept = {"checkpoints/step-000001/model.safetensors", "README.md", "images/loss.png", "eval_results.json"}
    pushes = iter(range(10**6))

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sets(st.sampled_from(NAMES), min_size=1), min_size=2, max_size=3),
           st.sampled_from(["", "checkpoints/step-000002"]))
    def check(uploads, at):  # at: the root (the final model, export --push-to-hub) or a checkpoint's folder
        n = next(pushes)
        repo, root = f"user/m{n}", store / "user" / f"m{n}" / "main"
        root.mkdir(parents=True)
        for name in kept:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(name)
        for i, names in enumerate(uploads):
            folder = tmp_path / f"export-{n}-{i}"
            for name in names:
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_text(f"{name} of upload {i}")
            if at:
                commit_folder(HfApi(), repo, folder, at, {}, "checkpoint")
            else:
                push_folder(folder, repo)
            there = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}
            new = {f"{at}/{name}" if at else name: f"{name} of upload {i}" for name in names}
            assert there == {**{k: k for k in kept}, **new}

    try:
        check()
        # the final model's card replaces a README.md of the folder: one file, not two adds of one path
        import warnings

        folder = tmp_path / "with-readme"
        folder.mkdir()
        (folder / "README.md").write_text("peft's own card")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            commit_folder(HfApi(), "user/m0", folder, "", {"README.md": "the run's card"}, "final")
        assert (store / "user" / "m0" / "main" / "README.md").read_text() == "the run's card"
    finally:
        proc.kill()
        proc.wait()


def test_a_resume_uploads_its_own_checkpoint_over_another_runs_of_that_step(tmp_path, monkeypatch):
    """A run publishing to a repo an earlier run filled, stopped before its step-2 went up: the
    resume listed the repo, took the earlier run's checkpoints/step-000002 for its own and never
    uploaded it. The run's ledger, kept from its start, decides; the repo's listing only stands in
    for a ledger lost with a copied run folder."""
    import shardtune.checkpoint.export as export
    from shardtune.config.schema import PublishConfig
    from shardtune.publish.hub import HubPublisher

    proc, store, endpoint = start_server(tmp_path)
    point_at(monkeypatch, endpoint)
    step2 = store / "user" / "two" / "main" / "checkpoints" / "step-000002"
    out, folder = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step-000002"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text("{}")

    def write_export(path, into, replace=False):  # this run's checkpoint, exported
        into.mkdir(parents=True, exist_ok=True)
        (into / "config.json").write_text("this run")

    monkeypatch.setattr(export, "write_export", write_export)
    p = PublishConfig(hub_repo="user/two", retries=1, wait_s=30)
    say = [].append
    try:
        for resuming, kept in ((False, True), (True, True), (True, False)):
            step2.mkdir(parents=True, exist_ok=True)
            (step2 / "config.json").write_text("an earlier run")
            if not kept:  # a run folder copied without publish/
                (out / "publish" / "ledger.json").unlink()
            hub = HubPublisher(p, out, say, resuming)
            if resuming:
                hub.checkpoint(folder, 2)
            hub.finish()
            expected = "this run" if kept and resuming else "an earlier run"
            assert (step2 / "config.json").read_text() == expected, (resuming, kept)
    finally:
        proc.kill()
        proc.wait()
