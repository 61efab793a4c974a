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
