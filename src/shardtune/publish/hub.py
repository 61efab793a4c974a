"""Uploads to a Hugging Face Hub repo while the run trains (`publish.*`), from rank 0 only.

Each committed checkpoint is exported from its DCP files (one process, one copy of the weights,
as `shardtune export` does: no rank gathers anything) and uploaded to checkpoints/step-N/; the
final model goes to the repo's root with a model card. All of it happens on one background
thread: the training step never waits for the network. A failure (no network, a bad token, a
rejected push, a full quota) is one warning line, printed once; training and the local
checkpoints are untouched. The thread is ours, not huggingface_hub's `run_as_future`: that
executor's worker is joined when Python exits, and huggingface_hub's HTTP client has no timeout,
so a hung Hub would keep a finished run's process alive for good (tests/publish/test_hub.py
runs the CLI against a hung server); a daemon thread lets the run exit after publish.wait_s. The
waits between attempts are huggingface_hub's own HTTP backoff (its preupload and file uploads
retry 408, 429, 5xx and network errors); `publish.retries` repeats a whole commit that still
failed. What was uploaded is kept in OUT/publish/ledger.json (where that is lost, the repo's
file list is read at start), so a resumed run does not upload it again.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from pathlib import Path

from shardtune.errors import UserError, first_line
from shardtune.fsio import json_loads, write_text_atomic

TOKEN_FIX = "set HF_TOKEN or run `hf auth login`"


def hub_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def check_ready(p, say=print) -> bool:
    """At start-up, before the model is built: whether this run publishes to the Hub. A missing
    token is an error, or with publish.required=false one line and a run that does not publish.
    (The repo id's form is checked with the config.)"""
    if not p.hub_repo:
        return False
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        if p.required:
            raise UserError(f"publish.hub_repo={p.hub_repo} needs the network, but HF_HUB_OFFLINE is set; unset it "
                            "(or publish.required=false to train without publishing)")
        say(f"warning: HF_HUB_OFFLINE is set; this run does not publish to {p.hub_repo} (publish.required=false)")
        return False
    if hub_token():
        return True
    if p.required:
        raise UserError(f"publish.hub_repo={p.hub_repo} needs a Hub token with write access; {TOKEN_FIX} "
                        "(or publish.required=false to train without publishing)")
    say(f"warning: no Hub token; this run does not publish to {p.hub_repo} (publish.required=false); "
        f"{TOKEN_FIX} to publish")
    return False


def _fatal(exc: BaseException) -> bool:
    """Errors that a retry cannot fix: authentication, permission, quota, a missing repo."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status in (401, 402, 403, 404, 413) or type(exc).__name__ in ("RepositoryNotFoundError",
                                                                         "RevisionNotFoundError")


# What an upload replaces at its place: the files a model or adapter folder is made of (weights and
# their index, configs, tokenizer files, final/'s record of its step), and an adapter's base/ copy.
# Anything else stays: what a person put in the repo (a README, a license, images, results),
# checkpoints/ (uploaded on their own).
MODEL_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json", "*config.json", "tokenizer*",
               "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model", "*.tiktoken",
               "chat_template.*", "shardtune_config.yaml", "shardtune.json")  # checkpoint.folders.FINAL_RECORD


def replaced(name: str) -> bool:
    """Whether a file at `name` (relative to an upload's place) is a model folder's, which a new
    upload there replaces or removes."""
    from fnmatch import fnmatchcase

    return name.startswith("base/") or ("/" not in name and any(fnmatchcase(name, p) for p in MODEL_FILES))


def commit_folder(api, repo: str, folder: Path, path_in_repo: str, texts: dict, message: str,
                  revision: str = "main", adapter_base: str | None = None) -> None:
    """One commit that makes `path_in_repo` (the root: "") hold `folder`'s files plus `texts`
    ({name: text}), an adapter_config.json naming `adapter_base` when given (adapter_base.py). A
    file an earlier upload left there that this one lacks is deleted in the same commit: a model
    in one file beside a newer one in shards (transformers prefers the single file), or an earlier
    adapter's files beside a full model, would load the earlier weights or mix two runs' files. Only
    a model folder's files are removed (`replaced`)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    from shardtune.publish.adapter_base import with_base

    def content(f: Path):
        return with_base(f, adapter_base) if adapter_base and f.name == "adapter_config.json" else str(f)

    prefix = f"{path_in_repo.strip('/')}/" if path_in_repo.strip("/") else ""
    ops = [CommitOperationAdd(prefix + f.relative_to(folder).as_posix(), content(f))  # a text replaces its file
           for f in sorted(folder.rglob("*")) if f.is_file() and f.relative_to(folder).as_posix() not in texts]
    ops += [CommitOperationAdd(prefix + name, text.encode()) for name, text in texts.items()]
    new = {op.path_in_repo for op in ops}
    try:
        there = api.list_repo_files(repo, revision=revision)
    except Exception as exc:  # a new branch or repo has nothing to replace; anything else is the commit's failure
        if type(exc).__name__ not in ("RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError"):
            raise
        there = []
    ops += [CommitOperationDelete(f) for f in there
            if f.startswith(prefix) and f not in new and replaced(f[len(prefix):])]
    api.create_commit(repo, ops, commit_message=message, revision=revision)


def push_folder(folder: Path, repo: str, private: bool = False, adapter_base: str | None = None) -> None:
    """`shardtune export --push-to-hub`: the exported folder becomes the repo's main (its adapter
    config naming `adapter_base` when given); any hub failure (no network, no token) is one line."""
    from huggingface_hub import HfApi, constants

    try:
        api = HfApi()
        api.create_repo(repo, private=private, exist_ok=True)
        commit_folder(api, repo, folder, "", {}, "Upload with shardtune export", adapter_base=adapter_base)
    except Exception as exc:  # the hub raises many kinds; the user needs the first line of any
        raise UserError(f"could not push to the hub repo {repo!r} ({type(exc).__name__}: {first_line(exc)}); check the "
                        f"network and `hf auth login`; the export itself is in {folder}") from None
    print(f"pushed {folder} to {constants.ENDPOINT}/{repo}", flush=True)


class Ledger:
    """OUT/publish/ledger.json: the items (checkpoints/step-N, final) already in repo@revision."""

    def __init__(self, path: Path, repo: str, revision: str):
        self.path, self.key = path, f"{repo}@{revision}"
        try:
            saved = json_loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        self.items: dict = saved.get(self.key, {}) if isinstance(saved, dict) else {}
        self.all = saved if isinstance(saved, dict) else {}
        self.kept = self.key in self.all  # this run's own record of the repo, since it began publishing there

    def __contains__(self, item: str) -> bool:
        return item in self.items

    def add(self, item: str | None = None, step: int | None = None, **seconds: float) -> None:
        """Record `item` as uploaded; with none, the (empty) record a run keeps from its start."""
        if item is not None:
            self.items[item] = {"step": step, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                **{k: round(v, 3) for k, v in seconds.items()}}
        self.all[self.key] = self.items
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(self.all, indent=1) + "\n")


class HubPublisher:
    """Rank 0's upload queue. `checkpoint(folder, step)` and `final(folder, step, card, config)`
    return at once; `finish()` waits (at most publish.wait_s) for what is still in flight."""

    def __init__(self, p, out: Path, say=print, resuming: bool = False):
        self.p, self.repo, self.revision, self.say = p, p.hub_repo, p.revision, say
        self.staging = out / "publish" / "staging"
        self.ledger = Ledger(out / "publish" / "ledger.json", self.repo, self.revision)
        self.jobs: queue.Queue = queue.Queue()  # unfinished_tasks: the uploads queued or running
        self.uploaded, self.failed, self.skipped = [], [], []
        self.warned = self.closed = False
        self.ready = False  # the repo (and branch) exist
        self.adapter_base = None  # the hub id an uploaded adapter_config.json names (adapter_base.py)
        self.resuming = resuming  # a fresh run replaces what an earlier one left in the repo
        if not resuming:  # its record from the start: a resume trusts it, not another run's step-N in the repo
            self.ledger.add()
        self.thread = threading.Thread(target=self._work, name="shardtune-hub", daemon=True)
        self.thread.start()

    # ---- the trainer's side (never blocks)

    def checkpoint(self, folder: Path, step: int) -> None:
        if self.p.checkpoints:
            self.jobs.put(("checkpoint", f"checkpoints/{folder.name}", Path(folder), step, None))

    def final(self, folder: Path, step: int, card: str, config_yaml: str) -> None:
        self.jobs.put(("final", "final", Path(folder), step, {"README.md": card, "shardtune_config.yaml": config_yaml}))

    def finish(self, limit: float | None = None) -> None:
        """Wait for the uploads in flight (at most publish.wait_s, or `limit` when shorter: a
        preempted run leaves what is left to its resume), with a progress line, then a summary."""
        wait = self.p.wait_s if limit is None else min(limit, self.p.wait_s)
        deadline, last_note = time.monotonic() + wait, 0.0
        while self.jobs.unfinished_tasks and time.monotonic() < deadline:
            if time.monotonic() - last_note > 10:
                self.say(f"publish: waiting for {self.jobs.unfinished_tasks} upload(s) to {self.repo} "
                         f"(at most {deadline - time.monotonic():.0f}s more, publish.wait_s)")
                last_note = time.monotonic()
            time.sleep(0.05)
        late = self.jobs.unfinished_tasks
        self.jobs.put(None)
        self.closed = True  # an upload that hung and fails later says nothing more
        parts = [f"{len(self.uploaded)} uploaded"] + ([f"{len(self.failed)} failed"] if self.failed else []) + \
            ([f"{late} still in flight after {wait:g}s (publish.wait_s)"] if late else [])
        from huggingface_hub import constants

        self.say(f"publish: {', '.join(parts)} to {constants.ENDPOINT}/{self.repo} ({self.revision})"
                 + ("; the local files stay in the run folder (`shardtune export ... --push-to-hub` uploads them "
                    "later)" if self.failed or late else ""))

    # ---- the background thread

    def _work(self) -> None:
        if self.resuming and not self.ledger.kept:
            self._read_repo()
        while (job := self.jobs.get()) is not None:
            try:
                self._run(*job)
            except Exception as exc:  # never let the thread die with jobs still counted
                self._warn(job[1], exc)
                self.failed.append(job[1])
            finally:
                self.jobs.task_done()

    def _read_repo(self) -> None:
        """On a resume without the run's own record (a ledger lost with a copied run folder), the
        checkpoints already in the repo count as published. Where the record is kept it alone
        decides: a step-N an earlier run left in the repo was taken for this run's, which then
        never uploaded its own."""
        try:
            from huggingface_hub import HfApi

            files = HfApi().list_repo_files(self.repo, revision=self.revision)
        except Exception:  # no repo yet, no network: the ledger alone decides
            return
        for f in files:
            parts = f.split("/")
            if len(parts) == 3 and parts[0] == "checkpoints" and parts[2] in ("config.json", "adapter_config.json"):
                self.ledger.items.setdefault(f"checkpoints/{parts[1]}", {"step": None, "seen_in_repo": True})

    def _run(self, kind: str, item: str, folder: Path, step: int, extra: dict | None) -> None:
        t0 = time.perf_counter()
        if item in self.ledger and kind == "checkpoint":
            self.skipped.append(item)
            return
        if kind == "checkpoint":
            if not (folder / "meta.json").is_file():  # removed by checkpoint.keep_last before its turn
                self.say(f"publish: {folder.name} was removed (checkpoint.keep_last) before it could be "
                         "uploaded; skipped")
                self.skipped.append(item)
                return
            from shardtune.checkpoint.export import write_export

            export = self.staging / folder.name
            write_export(folder, export, replace=True)
            seconds = {"export_s": time.perf_counter() - t0}
            try:
                self._upload(export, item, {}, f"checkpoint at step {step} (shardtune)")
            finally:
                shutil.rmtree(export, ignore_errors=True)
        else:
            seconds = {}
            self._upload(folder, "", extra or {}, f"final model at step {step} (shardtune)")
        seconds["upload_s"] = time.perf_counter() - t0 - seconds.get("export_s", 0.0)
        self.ledger.add(item, step, **seconds)
        self.uploaded.append(item)

    def _upload(self, folder: Path, path_in_repo: str, texts: dict, message: str) -> None:
        """One commit of `folder`'s files under `path_in_repo` plus `texts`, with retries."""
        from huggingface_hub import HfApi

        api = HfApi()
        for attempt in range(1, self.p.retries + 1):
            try:
                if not self.ready:
                    api.create_repo(self.repo, private=self.p.private, exist_ok=True)
                    if self.revision != "main":
                        api.create_branch(self.repo, branch=self.revision, exist_ok=True)
                    self.ready = True
                commit_folder(api, self.repo, folder, path_in_repo, texts, message, self.revision, self.adapter_base)
                return
            except Exception as exc:
                if _fatal(exc) or attempt == self.p.retries:
                    raise

    def _warn(self, item: str, exc: BaseException) -> None:
        if self.warned or self.closed:
            return
        self.warned = True
        self.say(f"warning: could not upload {item} to the Hub repo {self.repo} ({type(exc).__name__}: "
                 f"{first_line(exc)}); training goes on and the local checkpoints stay; check the network, "
                 f"the token ({TOKEN_FIX}), write access to {self.repo} and its storage quota "
                 "(further upload failures of this run are not repeated)")
