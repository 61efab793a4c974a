"""Trackers across runs of one process and before anything is built: each run logs into its own
folder, and what a run's trackers cannot use is refused at the start."""

from __future__ import annotations

import os

import pytest

from shardtune.telemetry.trackers import Trackers


def test_each_run_of_one_process_keeps_its_mlflow_store_in_its_own_folder(tmp_path, monkeypatch):
    """mlflow.set_tracking_uri exports the URI it is given as MLFLOW_TRACKING_URI: a second run of
    the same process (a notebook, a library caller) logged into the first run's mlruns/."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("first", "second"):
        t = Trackers(["mlflow"], tmp_path / name, {"lr": 0.1}, "shardtune-test", name)
        t.log({"loss": 1.0}, 1)
        t.close()
        assert "MLFLOW_TRACKING_URI" not in os.environ  # the user's environment, as it was
    for name in ("first", "second"):
        runs = [p for p in (tmp_path / name / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
        assert len(runs) == 1, name


def test_mlflow_logs_where_the_users_tracking_uri_says(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "store"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    (tmp_path / "run").mkdir()
    t = Trackers(["mlflow"], tmp_path / "run", {"lr": 0.1}, "shardtune-test", "run")
    t.log({"loss": 1.0}, 1)
    t.close()
    assert os.environ["MLFLOW_TRACKING_URI"] == store.as_uri()
    assert [p for p in store.glob("*/*") if (p / "metrics").is_dir()]
    assert not (tmp_path / "run" / "mlruns").exists()


def test_mlflow_keeps_the_config_values_it_can_hold(tmp_path, monkeypatch):
    """Every parameter was cut at 500 characters, where MLflow holds 6,000: a chat template of 1,200
    was recorded cut. What MLflow cannot hold is cut at its limit, not a refused run."""
    pytest.importorskip("mlflow")
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}" * 24
    config = {"data": {"chat_template": template, "path": "x" * (MAX_PARAM_VAL_LENGTH + 10)}}
    Trackers(["mlflow"], tmp_path, config, "shardtune-test", "run").close()
    params = {p.name: p.read_text() for p in (tmp_path / "mlruns").rglob("params/*")}
    assert params == {"data.chat_template": template, "data.path": "x" * MAX_PARAM_VAL_LENGTH}
