"""ruff (lint and import order, pyproject.toml's [tool.ruff]) over the whole repository, so CI
runs it with the README's one test command."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their basename (rootdir-relative, no packages): a second
    tests/*/test_x.py stops the whole collection with 'import file mismatch' (it did twice, each time
    a helper's new file beside an older one of the same name in another folder)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
