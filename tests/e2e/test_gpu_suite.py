"""bench/gpu/run.sh's plumbing, on CPU and fast: every stage's command line is accepted by its
script (ARGS_ONLY=1, for the GPU and the rehearsal command lines), and one stage runs end to end
through the suite (the profile of the Llama setup, rehearsed at a tiny size) into its results
folder, summary, tarball and the three files to bring back; a stage without the time it needs is
skipped and recorded. The whole rehearsal (`bash bench/gpu/run.sh --rehearse DIR`, every stage,
about 3 minutes on 2 cores) is timed in BENCHMARKS.md."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT, child_env

STAGES = ["tests", "bench-llama", "bench-opt", "curve", "offload", "nan-hunt", "profile", "plan", "speed-order",
          "float8-tests", "float8", "liger-tests", "liger", "head-chunks", "soak"]
TEST_STAGES = {"tests": "cuda-tests.log", "float8-tests": "float8-tests.log", "liger-tests": "liger-tests.log"}


def suite(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = child_env(PYTHON=sys.executable, SHARDTUNE_BENCH_DIR=str(tmp_path / "scratch"),
                    SHARDTUNE_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run(["bash", "bench/gpu/run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def stages(results) -> list[tuple[str, str]]:
    return [tuple(line.split("\t")[:2]) for line in (results / "stages.tsv").read_text().splitlines()]


@pytest.mark.parametrize("mode", [[], ["--rehearse"]], ids=["gpu", "rehearsal"])
def test_every_stage_command_line_is_accepted(tmp_path, mode):
    results = tmp_path / "results"
    # the test stages' pytest command lines are the same in both modes: collected once (seconds each)
    names = STAGES if not mode else [name for name in STAGES if name not in TEST_STAGES]
    proc = suite(tmp_path, *mode, str(results), ARGS_ONLY="1", SOAK_MINUTES="1", STAGES=" ".join(names),
                 TESTS_WORKERS="2")  # the tests stage under pytest-xdist, as on the H200
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert stages(results) == [(name, "0") for name in names]
    for log in [TEST_STAGES[name] for name in names if name in TEST_STAGES]:
        assert re.search(r"\b[1-9]\d*/\d+ tests collected \([1-9]\d* deselected\)", (results / log).read_text())
    assert "| soak | 0 |" in (results / "summary.md").read_text()


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_a_rehearsed_stage_end_to_end(tmp_path):
    results, back = tmp_path / "results", tmp_path / "back"
    proc = suite(tmp_path, "--rehearse", str(results), str(back), STAGES="profile plan", CAP_PLAN="20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert stages(results) == [("profile", "0"), ("plan", "skipped (budget)")]
    events = json.loads(gzip.open(results / "profile" / "trace.json.gz").read())["traceEvents"]
    assert len({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}) == 3
    summary = (results / "summary.md").read_text()
    assert "## Profile" in summary and "aten::" in summary and "| plan | skipped (budget) |" in summary
    # counted from the trace (on a CPU, the CPU kernels' own scalar reads are among them)
    assert re.search(r"host waits for the device in the traced steps, per step: aten::_local_scalar_dense \d", summary)
    assert sorted(p.name for p in back.iterdir()) == ["results.tar.gz", "suite.log", "summary.md"]
    with tarfile.open(back / "results.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./env.txt", "./summary.md", "./profile/ops.txt", "./profile/trace.json.gz"} <= names
    assert "GPU suite finished with status 0" in (back / "suite.log").read_text()


def test_the_curve_stage_fails_on_a_nan_or_a_gap_on_either_side(capsys):
    """The curve stage's verdict (vs_hf_trainer.compare_curves): HF Trainer's NaN shows (its
    logging_nan_inf_filter would log such a step's loss as a running mean, then 0.0: the first GPU
    run saw no HF NaN for that reason alone), shardtune's stop fails it, a gap beyond the tolerance too."""
    sys.path.insert(0, str(ROOT / "bench"))
    from vs_hf_trainer import compare_curves

    def pair(st: list, hf: list, **extra) -> list:
        return [(1, "full_shard", {"shardtune": [{"losses": st, **extra}], "hf": [{"losses": hf}]})]

    assert compare_curves(pair([10.0, 9.0, 8.0], [10.0, 9.1, 8.1]), 0.03) == 0
    assert compare_curves(pair([10.0, 9.0, 8.0], [10.0, 9.0, float("nan")]), 0.03) == 1
    assert compare_curves(pair([10.0, 9.0, None], [10.0, 9.0, 8.0]), 0.03) == 1  # skipped (on_nan=skip)
    assert compare_curves(pair([10.0, 9.0], [10.0, 9.0, 8.0]), 0.03) == 1  # stopped early
    assert compare_curves(pair([10.0, 8.0, 8.0], [10.0, 9.0, 8.0]), 0.03) == 1
    assert compare_curves(pair([], [10.0], error="gradient norm nan at step 4"), 0.03) == 1
    assert "❌" in capsys.readouterr().out
