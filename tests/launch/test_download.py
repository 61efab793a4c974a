"""`shardtune download` against tests/hub_server.py, a local server speaking the Hub's protocol:
what lands in the cache, a file changed on the Hub, and the refusals (one line, exit 2, the cache
untouched). What a recipe asks for and the offline refusals: test_slurm_download.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import point_at, start_server

from conftest import child_env, main_in_process


@pytest.mark.parametrize("target, token, message", [
    ("user/missing", "test-token", "'user/missing' not found on the Hugging Face hub"),
    ("user/tiny", "hf_invalid_token", "check the token (HF_TOKEN"),  # the Hub's 401 to an unknown token
    ("dataset:user/tiny", "hf_invalid_token", "check the token (HF_TOKEN"),
    ("model:user/a b", "test-token", "'model:user/a b' is not a recipe or a hub id"),
    ("dataset:../data", "test-token", "'dataset:../data' is not a recipe or a hub id"),
])
def test_download_refusals_against_a_hub_are_one_line(tmp_path, monkeypatch, target, token, message):
    """Against a local server speaking the Hub's protocol (tests/hub_server.py): a missing repo, a
    token the Hub refuses, an id the Hub cannot hold: one line naming the fix, exit 2, the cache
    folder (and what it held) untouched."""
    proc, store, endpoint = start_server(tmp_path)
    try:
        point_at(monkeypatch, endpoint)
        monkeypatch.setenv("HF_TOKEN", token)
        (store / "user" / "tiny" / "main").mkdir(parents=True)
        (store / "user" / "tiny" / "main" / "config.json").write_text("{}")
        cache = tmp_path / "cache"
        (cache / "hub").mkdir(parents=True)
        (cache / "hub" / "kept").write_text("x")
        code, err = main_in_process(["download", target, "--cache-dir", str(cache)])
    finally:
        proc.kill()
        proc.wait()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")) == ["hub", "hub/kept"]


def test_download_from_a_hub_fetches_what_loads_and_refetches_a_changed_file(assets, tmp_path, monkeypatch, capsys):
    """Against tests/hub_server.py: the snapshot holds the repo's files byte for byte but the
    formats shardtune never reads (.bin beside safetensors), the subfolders from_pretrained never
    reads (original/, a published run's checkpoints/step-N/: each a model) and root safetensors it
    does not read (beside model.safetensors, or named by no index); a file changed on the Hub
    is fetched again by the next download, and is what an offline process then reads."""
    from shardtune.cli.main import main

    proc, store, endpoint = start_server(tmp_path)
    repo = store / "user" / "tiny" / "main"
    files = {"config.json": b'{"a": 1}', "model.safetensors": b"weights", "pytorch_model.bin": b"bin",
             "original/consolidated.pth": b"o", "tokenizer/tokenizer.json": b"{}",
             "checkpoints/step-000001/model.safetensors": b"step 1"}
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    cache = tmp_path / "cache"
    try:
        point_at(monkeypatch, endpoint)
        snapshots = []
        for files["config.json"] in (b'{"a": 1}', b'{"a": 2}'):
            (repo / "config.json").write_bytes(files["config.json"])
            assert main(["download", "model:user/tiny", "--cache-dir", str(cache)]) == 0
            snapshots.append(Path(capsys.readouterr().out.split(" -> ")[1].split()[0]))
            got = {p.relative_to(snapshots[-1]).as_posix(): p.read_bytes()
                   for p in snapshots[-1].rglob("*") if p.is_file()}
            assert got == {k: v for k, v in files.items() if k in ("config.json", "model.safetensors")}
        # weights only in .bin: a safetensors file in a subfolder (another model's) does not make them skipped
        binonly = store / "user" / "binonly" / "main"
        for name in ("pytorch_model.bin", "extra/adapter_model.safetensors"):
            (binonly / name).parent.mkdir(parents=True, exist_ok=True)
            (binonly / name).write_bytes(b"w")
        assert main(["download", "user/binonly", "--cache-dir", str(cache)]) == 0
        fetched = Path(capsys.readouterr().out.split(" -> ")[1].split()[0])
        assert (fetched / "pytorch_model.bin").is_file() and not (fetched / "extra").exists()
        # root safetensors from_pretrained never reads: beside model.safetensors (which it takes first), or
        # not in the index (Mistral's consolidated.safetensors: the model twice over)
        for name, layout in (("single", {"model.safetensors": b"w", "model-00001-of-00002.safetensors": b"old"}),
                             ("sharded", {"model.safetensors.index.json": b'{"weight_map": {"a": "m-1.safetensors"}}',
                                          "m-1.safetensors": b"w", "consolidated.safetensors": b"c"})):
            for file, data in {"config.json": b"{}", **layout}.items():
                (store / "user" / name / "main").mkdir(parents=True, exist_ok=True)
                (store / "user" / name / "main" / file).write_bytes(data)
            assert main(["download", f"user/{name}", "--cache-dir", str(cache)]) == 0
            fetched = Path(capsys.readouterr().out.split(" -> ")[1].split()[0])
            assert sorted(p.name for p in fetched.iterdir()) == sorted(
                f for f in ["config.json", *layout] if f not in ("model-00001-of-00002.safetensors",
                                                                 "consolidated.safetensors"))
        # a recipe's tokenizer from another repo than its (local) model: that repo's weights are left
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"model:\n  name_or_path: {tmp_path}\n  tokenizer: user/tiny\n"
                          f"data:\n  path: {assets['train']}\n")
        assert main(["download", str(recipe), "--cache-dir", str(tmp_path / "tok-cache")]) == 0
        fetched = Path(capsys.readouterr().out.split("tokenizer user/tiny -> ")[1].split()[0])
        assert sorted(p.relative_to(fetched).as_posix() for p in fetched.rglob("*") if p.is_file()) == ["config.json"]
    finally:
        proc.kill()
        proc.wait()
    assert snapshots[0] != snapshots[1]
    offline = subprocess.run([sys.executable, "-c", "from huggingface_hub import hf_hub_download as get; "
                              "print(open(get('user/tiny', 'config.json')).read())"], capture_output=True, text=True,
                             env=child_env(HF_HOME=str(cache), HF_HUB_OFFLINE="1"))
    assert offline.stdout.strip() == '{"a": 2}', offline.stderr[-1000:]
