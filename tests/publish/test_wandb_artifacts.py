"""publish.wandb_artifacts with W&B offline (WANDB_MODE=offline): each checkpoint and the final
model are artifacts of the offline run, aliased latest and step-N, by reference or uploaded."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from conftest import train_tiny

BLOCK, HEADER = 32768, 7  # the run file is a LevelDB-style log: 32 KiB blocks of records


def offline_records(run_file: Path) -> list:
    """Every protobuf Record of an offline run's run-*.wandb file (W&B's own reader lives in its
    Go core): a 7-byte file header, then records of (crc32, length, type) + data, split over
    blocks (type 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, parts, records = run_file.read_bytes(), HEADER, b"", []
    assert data[:4] == b":W&B"
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def test_checkpoints_and_final_are_artifacts_in_the_offline_run(assets, tmp_path, monkeypatch):
    """Uploaded: W&B stages a copy of every file, sent when the offline run is synced."""
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train_tiny(assets, out, **{"train.max_steps": 2, "checkpoint.every_steps": 1, "checkpoint.keep_last": 0,
                               "log.trackers": "[wandb]", "publish.wandb_artifacts": "upload", "eval.max_batches": 1,
                               "eval.at_start": "false"})
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    arts = [r.artifact for r in offline_records(run_file) if r.WhichOneof("record_type") == "artifact"]
    got = [(a.name, a.type, sorted(a.aliases)) for a in arts]
    assert got == [("run-checkpoint", "checkpoint", ["latest", "step-1"]),
                   ("run-checkpoint", "checkpoint", ["latest", "step-2"]),
                   ("run-model", "model", ["final", "latest", "step-2"])], got
    final = {e.path: e for e in arts[-1].manifest.contents}
    assert {"config.json", "model.safetensors"} <= set(final)
    assert Path(final["model.safetensors"].local_path).read_bytes() == \
        (out / "final" / "model.safetensors").read_bytes()


def test_by_reference_the_artifact_points_at_the_run_files(tmp_path):
    """publish.wandb_artifacts=reference: file:// references to the local folder, nothing copied."""
    pytest.importorskip("wandb")
    from shardtune.telemetry.trackers import wandb_artifact

    folder = tmp_path / "step-000003"
    (folder / "sub").mkdir(parents=True)
    (folder / "meta.json").write_text("{}")
    (folder / "sub" / "shard.distcp").write_bytes(b"x" * 10)
    logged = []

    class Run:
        def log_artifact(self, art, aliases):
            logged.append((art, aliases))

    wandb_artifact(Run(), "reference")(folder, "run-checkpoint", "checkpoint", ["step-3", "latest"])
    (art, aliases), = logged
    assert (art.name, art.type, aliases) == ("run-checkpoint", "checkpoint", ["step-3", "latest"])
    refs = {e.ref for e in art.manifest.entries.values()}
    assert refs == {(folder / "meta.json").as_uri(), (folder / "sub" / "shard.distcp").as_uri()}, refs
