"""Traced steps kept on disk, keyed by everything that changes them: the model's config, the
config keys plan/keys.py does not call irrelevant, the ranks, the depth of the copy, the device
the trace mimics, and the code and library versions that trace it. A second `plan` of the same
model shape (another --gpu, --margin or --host-mem, the same recipe again) reads its small copies
instead of tracing them again. $SHARDTUNE_PLAN_CACHE names the folder, or `off`."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from shardtune.config.schema import RunConfig
from shardtune.fsio import json_loads
from shardtune.plan.trace import StepTrace

FORMAT = 1  # bump when StepTrace's fields change


@functools.cache
def code_version() -> str:
    """What traces a step: shardtune's source and the libraries the traced step runs."""
    import importlib.metadata

    digest = hashlib.sha256(str(FORMAT).encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    for dist in ("torch", "transformers", "peft", "torchao", "accelerate"):
        try:
            digest.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{dist} absent".encode())
    return digest.hexdigest()


def traced_keys(cfg: RunConfig) -> dict:
    """The config as the trace sees it: every key but those plan/keys.py calls irrelevant."""
    from shardtune.plan.keys import IRRELEVANT

    def flat(node, prefix=""):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                yield from flat(value, f"{prefix}{f.name}.")
            elif prefix + f.name not in IRRELEVANT:
                yield prefix + f.name, value
    return dict(flat(cfg))


class TraceCache:
    def __init__(self, folder: Path | None):
        self.folder = folder  # None: off
        self.hits = self.misses = 0
        self.announce = None  # said once, before the next trace that is not read from the folder

    @classmethod
    def default(cls) -> TraceCache:
        where = os.environ.get("SHARDTUNE_PLAN_CACHE", "")
        if where.lower() == "off":
            return cls(None)
        if not where:
            from shardtune.data.quickstart import default_cache_dir

            return cls(default_cache_dir().parent / "plan-traces")
        return cls(Path(where))

    def key(self, cfg: RunConfig, hf_config, world: int, local_world: int, layers: int | None, target: str) -> str:
        what = {"cfg": traced_keys(cfg), "model": hf_config.to_dict(), "world": world, "local": local_world,
                "layers": layers, "target": target, "code": code_version()}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()

    def trace(self, cfg: RunConfig, hf_config, world: int, local_world: int | None = None, layers: int | None = None,
              target: str = "cpu") -> StepTrace:
        """trace.trace_step(...), from the folder where it was traced before."""
        from shardtune.plan import trace as trace_lib

        local_world = local_world or world
        if self.folder is None:
            self._say_announce()
            return trace_lib.trace_step(cfg, hf_config, world, local_world, layers, target)
        path = self.folder / f"{self.key(cfg, hf_config, world, local_world, layers, target)}.json"
        try:
            stored = json_loads(path.read_text())
            self.hits += 1
            return StepTrace({tuple(k): v for k, v in stored["phases"]}, stored["layers"], stored["steady"],
                             stored["params"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        self._say_announce()
        trace = trace_lib.trace_step(cfg, hf_config, world, local_world, layers, target)
        self.misses += 1
        self._store(path, trace)
        return trace

    def _say_announce(self) -> None:
        announce, self.announce = self.announce, None
        if announce is not None:
            announce()

    def _store(self, path: Path, trace: StepTrace) -> None:
        """Written whole or not at all (a rename); a folder that cannot be written only costs speed."""
        data = {"phases": [[list(k), v] for k, v in trace.phases.items()], "layers": trace.layers,
                "steady": trace.steady, "params": trace.params}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                json.dump(data, f)
            os.replace(f.name, path)
        except OSError:
            pass
