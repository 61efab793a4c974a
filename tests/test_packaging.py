"""shardtune as a user installs it: a wheel built from this tree, installed into a folder of its
own, starts as the `shardtune` console script and as `python -m shardtune`, and `shardtune plan`
finds the model configs shipped inside the package (package data, not the source tree)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, child_env


def test_wheel_installs_starts_both_ways_and_ships_the_model_configs(tmp_path):
    import re

    import setuptools
    from packaging.version import Version

    needed = re.search(r'"setuptools>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    if Version(setuptools.__version__) < Version(needed):  # the build below uses this environment's
        pytest.skip(f"setuptools {setuptools.__version__} here; the build needs setuptools>={needed}")
    tree = tmp_path / "tree"  # build from a copy: an in-tree build would leave build/ and egg-info behind
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(tree)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert sorted(p.name for p in (site / "shardtune" / "plan" / "model_configs").glob("*.json")) == \
        sorted(p.name for p in (ROOT / "src" / "shardtune" / "plan" / "model_configs").glob("*.json"))

    # the installed copy only: not this tree, not the editable install; no hub, an empty cache
    env = child_env(PYTHONPATH=str(site), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    run = lambda *argv: subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env,  # noqa: E731
                                       cwd=tmp_path)
    where = run(sys.executable, "-c", "import shardtune; print(shardtune.__file__)")
    assert where.stdout.strip() == str(site / "shardtune" / "__init__.py"), where.stdout + where.stderr
    script = site / "bin" / "shardtune"  # the console script pip wrote from [project.scripts]
    for start in ([str(script)], [sys.executable, "-m", "shardtune"]):
        version = run(*start, "--version")
        assert version.returncode == 0 and version.stdout.startswith("shardtune "), version.stdout + version.stderr

    # the smallest plan that still reads GPT-2's shipped config.json: one precision, two blocks, one micro-batch
    plan = run(str(script), "plan", "model.name_or_path=openai-community/gpt2", "model.config={n_layer: 2}",
               "precision=fp16", "train.global_batch_size=2", "train.micro_batch_size=1", "data.seq_len=64",
               "--gpus", "1", "--gpu", "T4", "--json")
    assert plan.returncode == 0, plan.stderr
    assert "model config: the copy of its config.json shipped with shardtune (openai-community--gpt2.json)" \
        in plan.stderr, plan.stderr
    answer = json.loads(plan.stdout)
    assert answer["best"]["command"].startswith("shardtune train model.name_or_path=openai-community/gpt2"), answer
