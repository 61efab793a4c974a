"""publish.wandb_artifacts with W&B offline (WANDB_MODE=offline): each checkpoint and the final
model are artifacts of the offline run, aliased latest and step-N, by reference or uploaded."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

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
        if pos + HEADER + length > len(data):  # still being written
            break
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def test_artifacts_in_the_offline_run(tmp_path, monkeypatch):
    """Uploaded: W&B stages a copy of every file (sent when the offline run is synced); the
    aliases are latest and step-N (and final). The trainer's calls: tests/publish/test_hub.py."""
    pytest.importorskip("wandb")
    from shardtune.telemetry.trackers import Trackers

    for var, sub in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    folders = []
    for name in ("step-000001", "step-000002", "final"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"name": "{name}"}}')
        folders.append(tmp_path / name)
    t = Trackers(["wandb"], tmp_path, {}, "shardtune-test", "run", artifacts="upload")
    t.artifact(folders[0], 1, final=False)
    t.artifact(folders[1], 2, final=False)
    t.artifact(folders[2], 2, final=True)
    t.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30  # W&B's service process may flush the file after finish() returns
    records = offline_records(run_file)
    while "exit" not in [r.WhichOneof("record_type") for r in records]:
        assert time.monotonic() < deadline, "the offline run file never got its exit record"
        time.sleep(0.1)
        records = offline_records(run_file)
    arts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    got = [(a.name, a.type, sorted(a.aliases)) for a in arts]
    assert got == [("run-checkpoint", "checkpoint", ["latest", "step-1"]),
                   ("run-checkpoint", "checkpoint", ["latest", "step-2"]),
                   ("run-model", "model", ["final", "latest", "step-2"])], \
        [r.WhichOneof("record_type") for r in records]
    for art, folder in zip(arts, folders, strict=True):
        (entry,) = art.manifest.contents
        assert entry.path == "config.json" and Path(entry.local_path).read_text() == \
            (folder / "config.json").read_text()


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
