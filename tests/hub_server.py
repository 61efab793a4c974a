"""A local stand-in for the Hugging Face Hub: the few endpoints `huggingface_hub` (the installed
version) calls to create a repo, a branch, upload a folder (preupload + one ndjson commit, every
file "regular", i.e. inline base64, deleting files), list a repo's files and serve them to
`snapshot_download` (a revision's commit sha is one of its contents; a Range is honoured).
Files land in STORE/<ns>/<name>/<rev>/.

    python tests/hub_server.py STORE PORT_FILE [--deny-commits] [--hang-commits] [--fail-first-commit]

Listens on 127.0.0.1 only, on a free port that it writes to PORT_FILE. Every commit is also
appended to STORE/commits.jsonl ({"repo", "revision", "paths", "deleted"}), so a test sees what arrived and
when. --deny-commits answers every commit with 403 (a rejected push / full quota), and
--hang-commits never answers one (a hung server). --fail-first-commit answers the first commit
with 503 (a passing outage) and notes it in STORE/failed.jsonl."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

REPO = r"(?P<ns>[^/]+)/(?P<name>[^/]+)"


class Hub(BaseHTTPRequestHandler):
    store: Path
    deny = hang = fail_first = False
    lock = threading.Lock()

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, code: int, body=None, headers: dict | None = None) -> None:
        data = json.dumps(body if body is not None else {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def authorized(self) -> bool:
        """A token was sent, and it is not one the Hub would refuse (a test's "hf_invalid...")."""
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and not auth.startswith("Bearer hf_invalid"):
            return True
        self.reply(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def repo_dir(self, m, rev: str = "main") -> Path:
        return self.store / m["ns"] / m["name"] / unquote(rev)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        path = urlparse(self.path).path
        if not self.authorized():
            return
        if path == "/api/repos/create":
            req = json.loads(self.body())
            ns = req.get("organization") or "user"
            (self.store / ns / req["name"] / "main").mkdir(parents=True, exist_ok=True)
            return self.reply(200, {"url": f"http://{self.headers['Host']}/{ns}/{req['name']}"})
        if path == "/api/validate-yaml":
            self.body()
            return self.reply(200, {"errors": [], "warnings": []})
        if m := re.fullmatch(rf"/api/models/{REPO}/branch/(?P<rev>.+)", path):
            self.body()
            main = self.repo_dir(m)
            if not main.is_dir():
                return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            self.repo_dir(m, m["rev"]).mkdir(parents=True, exist_ok=True)
            return self.reply(200, {})
        if m := re.fullmatch(rf"/api/models/{REPO}/preupload/(?P<rev>.+)", path):
            files = json.loads(self.body())["files"]
            return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files], "commitOid": "0" * 40})
        if m := re.fullmatch(rf"/api/models/{REPO}/commit/(?P<rev>.+)", path):
            lines = [json.loads(line) for line in self.body().splitlines() if line.strip()]
            if self.hang:
                threading.Event().wait(3600)
            if self.deny:
                return self.reply(403, {"error": "You have exceeded your storage quota"})
            with self.lock:
                fail, Hub.fail_first = Hub.fail_first, False
            if fail:
                with open(self.store / "failed.jsonl", "a") as f:
                    f.write(json.dumps({"status": 503, "revision": unquote(m["rev"])}) + "\n")
                return self.reply(503, {"error": "Service temporarily unavailable"})
            root = self.repo_dir(m, m["rev"])
            if not root.is_dir():
                return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            paths, deleted = [], []
            for item in lines:
                if item["key"] == "file":
                    target = root / item["value"]["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(base64.b64decode(item["value"]["content"]))
                    paths.append(item["value"]["path"])
                elif item["key"] == "deletedFile":
                    (root / item["value"]["path"]).unlink()  # a file not there fails the commit, as the Hub does
                    deleted.append(item["value"]["path"])
            with self.lock, open(self.store / "commits.jsonl", "a") as f:
                f.write(json.dumps({"repo": f"{m['ns']}/{m['name']}", "revision": unquote(m["rev"]),
                                    "paths": sorted(paths), "deleted": sorted(deleted)}) + "\n")
            oid = hashlib.sha1(json.dumps(paths).encode()).hexdigest()
            return self.reply(200, {"commitUrl": f"http://{self.headers['Host']}/{m['ns']}/{m['name']}/commit/{oid}",
                                    "commitOid": oid})
        self.reply(404, {"error": f"not served here: POST {path}"})

    def files(self, m, rev: str) -> tuple[Path, list[Path], str] | None:
        """(the revision's folder, its files, its commit sha: one of their contents) for a branch
        or a sha; None when there is no such repo or revision."""
        repo = self.store / m["ns"] / m["name"]
        for root in sorted(repo.iterdir()) if repo.is_dir() else []:
            files = sorted(p for p in root.rglob("*") if p.is_file())
            sha = hashlib.sha1(json.dumps([(str(p.relative_to(root)), hashlib.sha1(p.read_bytes()).hexdigest())
                                           for p in files]).encode()).hexdigest()
            if unquote(rev) in (root.name, sha):
                return root, files, sha
        return None

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        path = urlparse(self.path).path
        if m := re.fullmatch(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path):  # a file's bytes
            found = self.files(m, m["rev"])
            if found is None or not (found[0] / unquote(m["file"])).is_file():
                return self.reply(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            data = (found[0] / unquote(m["file"])).read_bytes()
            start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
            self.send_response(206 if start else 200)
            for k, v in {"X-Repo-Commit": found[2], "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                         "Content-Length": str(len(data) - start)}.items():
                self.send_header(k, v)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data[start:])
            return None
        if path == "/api/whoami-v2":
            return self.reply(200, {"name": "user", "type": "user", "orgs": []}) if self.authorized() else None
        if self.headers.get("Authorization") and not self.authorized():  # a bad token, even for a public repo
            return None
        if m := re.fullmatch(rf"/api/models/{REPO}/revision/(?P<rev>[^/]+)", path):  # repo_info
            if (found := self.files(m, m["rev"])) is None:
                return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            root, files, sha = found
            return self.reply(200, {"id": f"{m['ns']}/{m['name']}", "sha": sha,
                                    "siblings": [{"rfilename": str(p.relative_to(root))} for p in files]})
        if m := re.fullmatch(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?P<sub>/.*)?", path):
            if (found := self.files(m, m["rev"])) is None:
                return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            root, files, _ = found
            return self.reply(200, [{"type": "file", "path": str(p.relative_to(root)), "size": p.stat().st_size,
                                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in files])
        self.reply(404, {"error": f"not served here: GET {path}"})


def start_server(tmp_path: Path, *flags: str):
    """(process, store, endpoint) of this server started in a process of its own (for tests)."""
    import subprocess
    import time

    from conftest import child_env

    store, port_file = tmp_path / "hub", tmp_path / "hub.port"
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(store), str(port_file),
                             *flags], env=child_env())
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "hub server did not start"
        time.sleep(0.05)
    return proc, store, f"http://127.0.0.1:{port_file.read_text()}"


def point_at(monkeypatch, endpoint: str) -> None:
    """This process's huggingface_hub and datasets talk to `endpoint` with a token (HF_ENDPOINT,
    the file URLs made from it and HF_HUB_OFFLINE are read once, at import)."""
    import datasets.config  # its own copy; imported before HF_ENDPOINT is set, so the test leaves it as it was
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "test-token")
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")


def main() -> None:
    store, port_file = Path(sys.argv[1]), Path(sys.argv[2])
    store.mkdir(parents=True, exist_ok=True)
    Hub.store, Hub.deny, Hub.hang = store, "--deny-commits" in sys.argv, "--hang-commits" in sys.argv
    Hub.fail_first = "--fail-first-commit" in sys.argv
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.daemon_threads = True
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.replace(port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
