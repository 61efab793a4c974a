"""A checkpoint folder on disk: its name and step, whether it is complete and usable, its
meta.json, the newest one, and whether a run may resume from it (checkpoint/dcp.py writes and
reads the tensors)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from shardtune.config.schema import RunConfig
from shardtune.errors import UserError
from shardtune.fsio import json_loads, write_text_atomic

# 2: named state objects in meta.json (train_state, scaler); the LR is a function of the step;
# 3: the model's weights may be in safetensors (meta.json's model_files; older versions cannot read them)
FORMAT = 3
MODEL_FILES = {False: "dcp", True: "safetensors"}
NAME = re.compile(r"^step-(\d+)$")
# Changing these breaks resume: the weights' shapes, or what "step N" means in the data order.
# Whole sections are compared, so a key added to one later is covered without a change here.
RESUME_KEYS = ("model.name_or_path", "model.config", "model.tokenizer", "data", "train.global_batch_size",
               "train.seed", "train.optimizer_state", "peft", "freeze")
MAY_CHANGE = {"data.num_proc", "peft.dropout"}  # inside those sections, but harmless
# in a run's final/ (written with it, atomically): {"step": N}, the step whose weights it holds
FINAL_RECORD = "shardtune.json"


# ----------------------------------------------------------------------------- finding


def step_of(path: Path) -> int:
    m = NAME.match(path.name)
    return int(m.group(1)) if m else -1


def is_complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) >= 0 and is_complete(p)), key=step_of)


def is_usable(path: Path) -> bool:
    """Complete, and its meta.json reads as a checkpoint's (a resume can start from it)."""
    if not is_complete(path):
        return False
    try:
        meta = json_loads((path / "meta.json").read_text())
        return isinstance(meta, dict) and "step" in meta and "config" in meta
    except (OSError, ValueError):
        return False


def finish_interrupted_saves(root: Path) -> None:
    """A save killed after its meta.json (written last: the checkpoint is whole) but before its
    renames (checkpoint/dcp.py): finished as the save would have gone on, renamed into place, named
    `latest`, the older copy of the same step it replaces removed. Left as they were, the restart
    removed both copies of that step and resumed from an older one. A save killed before its
    meta.json stays a partial, which the restart removes."""
    for tmp in sorted(root.glob(".tmp-step-*")) if root.is_dir() else []:
        final = root / tmp.name.removeprefix(".tmp-")
        if final.exists() or step_of(final) < 0 or not is_usable(tmp):
            continue
        os.rename(tmp, final)
        write_text_atomic(root / "latest", final.name + "\n", sync=True)
        shutil.rmtree(root / f".old-{final.name}", ignore_errors=True)


def find_latest(root: Path) -> Path | None:
    """`latest` if it names a usable checkpoint of `root`, else the usable one with the highest step.
    It names one by its folder name (as the saves write it): a path there (`/other/run/...`, `../..`)
    led export and resume=auto to another run's checkpoint without a word."""
    try:
        named = (root / "latest").read_text().strip()
        if NAME.match(named) and is_usable(root / named):
            return root / named
    except (OSError, ValueError):
        pass
    found = [p for p in complete_checkpoints(root) if is_usable(p)]
    return found[-1] if found else None


def final_step(final: Path) -> int | None:
    """The step a run's final/ holds (its FINAL_RECORD); None for one of an older shardtune."""
    try:
        record = json_loads((final / FINAL_RECORD).read_text())
    except (OSError, ValueError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if _whole(step) else None


@dataclass(frozen=True)
class RunWeights:
    """The weights a run folder stands for: its final/ (`final`) or one of its checkpoints."""

    path: Path
    step: int | None
    final: bool

    def line(self, run) -> str:
        """What a command given `run` says first: which weights it reads, and why those."""
        step = f"step {self.step}" if self.step is not None else "step not recorded"
        if self.final:
            return f"{run}: the run's final model {self.path} ({step})"
        return f"{run}: its newest checkpoint {self.path} ({step}; no final/ of that step)"


def run_folder(spec: str) -> Path | None:
    """The shardtune run folder that `spec` (a run folder, its final/, checkpoints/, one of its
    checkpoints or their `latest` pointer) is part of, or None."""
    path = Path(spec).expanduser()
    for folder in (path, path.parent, path.parent.parent):
        if (folder / "metrics.jsonl").is_file() and (folder / "config.yaml").is_file():
            return folder
    return None


def run_trusts(folder) -> bool:
    """Whether `folder` (a model folder: a run's final/) is of a run that trusted its model's code
    (model.trust_remote_code): eval, generate and export read it as that run wrote it, where a
    plain folder's code is never run unasked. A run config this shardtune cannot read trusts nothing
    (the command goes on to its own checks, which name what is wrong)."""
    from shardtune.config.load import load_saved_config

    run = run_folder(str(folder))
    try:
        return bool(run and load_saved_config(run / "config.yaml").model.trust_remote_code)
    except UserError:
        return False


def is_run_folder(path: Path) -> bool:
    return path.name not in ("final", "checkpoints") and ((path / "final").is_dir() or (path / "checkpoints").is_dir())


def run_weights(run: Path) -> RunWeights | None:
    """The one rule for what a run folder means to every command given it (eval, generate, export,
    export --push-to-hub): its final/ unless a complete checkpoint of a later step exists (a resume
    that trained on and stopped before its own final/), else its newest complete checkpoint. A
    final/ of an older shardtune records no step and counts as the newest. None: neither exists, or
    `run` is no run folder (is_run_folder: its final/ or checkpoints/ folder itself is not one)."""
    if not is_run_folder(run):
        return None
    final = run / "final"
    ckpt = find_latest(run / "checkpoints")
    if (final / "config.json").is_file() or (final / "adapter_config.json").is_file():
        step = final_step(final)
        if ckpt is None or step is None or step >= step_of(ckpt):
            return RunWeights(final, step, True)
    return RunWeights(ckpt, step_of(ckpt), False) if ckpt is not None else None


def export_source(spec: str | Path) -> RunWeights:
    """What `export SPEC` reads: a run folder's run_weights, else the checkpoint SPEC names."""
    path = Path(spec).expanduser()
    picked = run_weights(path)
    if picked is None:
        path = resolve_checkpoint(path)
        picked = RunWeights(path, read_meta(path)["step"], False)
    return picked


def why_no_checkpoint(root: Path) -> str:
    """What `root` (a run's checkpoints folder) holds instead of a usable checkpoint, in words."""
    if root.is_symlink() and not root.exists():
        return f"{root} is a link to {os.readlink(root)}, which is not there (a disk not mounted?)"
    if not root.exists():
        return f"there is no {root.name}/ folder"
    if not root.is_dir():
        return f"{root} is not a folder"
    notes = []
    try:
        named = (root / "latest").read_text().strip()
        if named and not (root / named).exists():
            notes.append(f"{root / 'latest'} names {named}, which is gone")
    except (OSError, ValueError):
        pass
    steps = [p for p in root.iterdir() if step_of(p) >= 0]
    broken = [p.name for p in steps if is_complete(p) and not is_usable(p)]
    if broken:
        notes.append(f"unreadable meta.json in {', '.join(sorted(broken))}")
    if len(broken) < len(steps):
        notes.append(f"{len(steps) - len(broken)} step folder(s) incomplete (meta.json or .metadata missing)")
    if cut := len(list(root.glob(".tmp-step-*"))):
        notes.append(f"{cut} save(s) cut short")
    return "; ".join(notes) or f"{root} holds no step-N checkpoint folder"


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _meta_shape_ok(meta) -> bool:
    """The keys and types of meta.json that everything reading it relies on."""
    if not isinstance(meta, dict) or not _whole(meta.get("step")) or not isinstance(meta.get("config"), dict):
        return False
    state, sections = meta.get("train_state"), [meta["config"].get(k, {}) for k in ("model", "peft", "data")]
    return (_whole(meta.get("format", 1)) and _whole(meta.get("world_size", 1)) and meta.get("world_size") != 0
            and all(isinstance(s, dict) for s in sections)
            and (state is None or (isinstance(state, dict) and _whole(state.get("step"))
                                   and _count(state.get("tokens_seen", 0)))))


def _count(value) -> bool:
    """A number 0 or more that a float holds (a count kept as one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= sys.float_info.max


def is_model_folder(path: Path) -> bool:
    """A plain Hugging Face model folder (config.json and weights), not a checkpoint or a part of one
    (no meta.json, DCP .metadata or shards)."""
    return ((path / "config.json").is_file() and not (path / "meta.json").exists()
            and not (path / ".metadata").exists() and not any(path.glob("*.distcp"))
            and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))))


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, or a one-line UserError saying what is wrong with it."""
    if not path.exists():
        raise UserError(f"checkpoint {str(path)!r} not found; give a checkpoint folder "
                        "(OUTPUT_DIR/checkpoints/step-N) or a run's output_dir")
    if is_model_folder(path):
        raise UserError(f"{str(path)!r} is a Hugging Face model folder, not a shardtune checkpoint (no meta.json); "
                        "use it as it is (model.name_or_path, eval, generate), or give a checkpoint folder")
    if (path / "adapter_config.json").is_file() and not (path / "meta.json").exists():  # a peft run's final/
        raise UserError(f"{str(path)!r} is a peft adapter folder, not a shardtune checkpoint (no meta.json); use it "
                        f"as it is (eval, generate), fold it into its base with `shardtune export {path} OUT --merge`, "
                        "or give a checkpoint folder")
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is a file, not a checkpoint folder; give a checkpoint folder "
                        "(OUTPUT_DIR/checkpoints/step-N) or a run's output_dir")
    if not (path / "meta.json").exists() and not (path / ".metadata").exists():  # no part of a checkpoint
        if (path / "final").is_dir():
            raise UserError(f"{str(path)!r} is a run folder without checkpoints; its "
                            f"final/ is the trained model: use {str(path / 'final')!r} as it is (eval, generate, "
                            "model.name_or_path)")
        raise UserError(f"{str(path)!r} is not a shardtune checkpoint (no meta.json, no .metadata); give a checkpoint "
                        "folder (OUTPUT_DIR/checkpoints/step-N) or a run's output_dir")
    if not (path / "meta.json").is_file() or not (path / ".metadata").is_file():
        raise UserError(f"{str(path)!r} is not a complete shardtune checkpoint (meta.json or .metadata missing: "
                        "an interrupted save?); use another checkpoint of the run")
    try:
        meta = json_loads((path / "meta.json").read_text(encoding="utf-8"))
    except ValueError:
        meta = None
    if not _meta_shape_ok(meta):
        raise UserError(f"checkpoint {str(path)!r} is corrupt (unreadable meta.json); use another checkpoint")
    if meta.get("format", 0) > FORMAT:
        raise UserError(f"checkpoint {str(path)!r} was written by a newer shardtune "
                        f"({meta.get('shardtune_version')}); upgrade shardtune")
    if meta.get("format", 1) == 1:  # progress was kept at the top level (and a scheduler, now derived)
        meta.setdefault("train_state", {"step": meta["step"], "tokens_seen": meta.get("tokens_seen", 0.0)})
    named, state = step_of(path), meta.get("train_state") or {}
    steps = {meta["step"], *([state["step"]] if "step" in state else []), *([named] if named >= 0 else [])}
    if len(steps) > 1:  # a hand edit: a resume would go on from a step its weights never reached
        raise UserError(f"checkpoint {str(path)!r} is inconsistent: its folder name and meta.json give steps "
                        f"{', '.join(map(str, sorted(steps)))} (edited?); use another checkpoint")
    return meta


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint folder, or the newest complete checkpoint of a run folder (or of its
    checkpoints/, or what its checkpoints/latest names)."""
    path = Path(spec).expanduser()
    if path.name == "latest" and path.is_file():  # the pointer file: the checkpoints folder it sits in
        path = path.parent
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if root.is_dir() and not (path / "meta.json").exists() and (root != path or path.name == "checkpoints"):
        latest = find_latest(root)
        if latest is None:
            raise UserError(f"{str(root)!r} holds no complete checkpoint; give another checkpoint or start over")
        return latest
    read_meta(path)
    return path


def check_compatible(saved: dict, now: dict, path: Path) -> None:
    """Refuse a resume whose config changes what the checkpoint holds; anything else may change."""
    def get(tree, key):
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    changed, defaults = [], RunConfig().to_dict()
    for key in RESUME_KEYS:
        old, new = get(saved, key), get(now, key)
        if isinstance(old, dict) and isinstance(new, dict):  # name the changed sub-keys only
            # a key added to the config after the checkpoint was written had its default then
            old = {**(get(defaults, key) or {}), **old}
            changed += [f"{key}.{k} {short(old.get(k))} -> {short(new.get(k))}"
                        for k in sorted(old.keys() | new.keys())
                        if old.get(k) != new.get(k) and f"{key}.{k}" not in MAY_CHANGE]
        elif old != new and not (old is None and new == get(defaults, key)):  # None: saved before the key existed
            changed.append(f"{key} {short(old)} -> {short(new)}")
    if changed:
        raise UserError(f"cannot resume from {str(path)!r}: {'; '.join(changed)} changed; resume with the "
                        "checkpoint's values (lr, max_steps, eval and log settings may change) or use a new output_dir")


def check_same_data(meta: dict, sequences: int, next_batch: str, path) -> None:
    """Refuse a resume whose training split is not the one its checkpoint's steps counted: the config
    can be the same while the files under data.path (or a hub dataset's revision) changed, and the
    seeded order of another split made "step N" other samples, without a word. At the same count,
    `next_batch` (data.batches.batch_key of the step the resume trains first) must be the checkpoint's:
    another shuffle (another shardtune's batch plan, torch's randperm) or other documents (the hold-out
    drawn otherwise, files edited) trained the rest of the epoch on other samples, some twice."""
    data = meta.get("data") if isinstance(meta.get("data"), dict) else {}
    saved = data.get("sequences_per_epoch")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved != sequences:
        raise UserError(f"cannot resume from {str(path)!r}: the training split now holds {sequences} sequences, the "
                        f"checkpoint's run trained on {saved} (the files under data.path, or their tokenization, "
                        "changed since); restore that data, or start over in a new output_dir")
    if isinstance(data.get("next_batch"), str) and data["next_batch"] != next_batch:
        raise UserError(f"cannot resume from {str(path)!r}: step {meta['step'] + 1} would train other sequences than "
                        "the checkpoint's run (the same count; the files under data.path, their tokenization or "
                        "hold-out, or the data order of this shardtune or torch changed since); restore them, or "
                        "start over in a new output_dir")
