"""MFU arithmetic, trackers in their offline modes, and the report's plots."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from shardtune.errors import UserError
from shardtune.telemetry.flops import device_peak_flops, flops_per_token
from shardtune.telemetry.metrics import memory_stats
from shardtune.telemetry.report import write_report
from shardtune.telemetry.trackers import Histogram, Trackers


def test_flops_per_token_is_six_n_plus_attention():
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12)
    assert flops_per_token(124_000_000, cfg, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "opt"])
def test_counted_attention_is_the_formulas_where_the_formula_knows_the_family(model_type):
    """FlopCounterMode over the real model on meta tensors gives the hand formula's attention term
    (4 x layers x hidden x seq_len per token forward; 3 x that in training) for these families."""
    from archs import hf_config

    from shardtune.families import hidden_size, layer_count
    from shardtune.telemetry.flops import attention_flops

    cfg = hf_config(model_type)
    before = cfg.to_dict()
    assert attention_flops(cfg, 48) == 4 * layer_count(cfg) * hidden_size(cfg) * 48
    assert cfg.to_dict() == before  # counting leaves the caller's config as it was (plan's cache keys it)
    assert flops_per_token(1000, cfg, 48, 10) == 4 * 1000 + 2 * 10 + 12 * layer_count(cfg) * hidden_size(cfg) * 48


@pytest.mark.parametrize("model_type, extra, per_layer", [
    ("qwen3", {"head_dim": 32}, 4 * 4 * 32),  # 4 heads of 32 on a hidden size of 64: twice the formula's
    ("deepseek_v3", {"v_head_dim": 32}, 2 * 4 * 16 + 2 * 4 * 32),  # latent attention: scores 16, values 32 wide
])
def test_counted_attention_follows_what_the_formula_does_not_know(model_type, extra, per_layer):
    from archs import hf_config

    from shardtune.telemetry.flops import attention_flops

    cfg = hf_config(model_type, **extra)
    assert attention_flops(cfg, 48) == 2 * per_layer * 48  # 2 layers, seq_len 48


@pytest.mark.parametrize("model_type, extra", [
    ("mixtral", None), ("deepseek_v3", None),
    # their top-k under other names: no expert was counted (MFU and plan left out most of the matmuls)
    ("gemma4_text", {"head_dim": 16, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                     "moe_intermediate_size": 32, "vocab_size_per_layer_input": 300}),
    ("aria_text", {"moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 1}),
    # weights no token meets: Gemma 3's vision tower (MFU 1.9x the tiny model's), BART's cross-attention
    ("gemma3", "tiny"), ("bart", "tiny"),
])
def test_matmul_params_are_the_weights_a_token_meets(model_type, extra):
    """2 x matmul_params x tokens is the forward's matmul FLOPs as torch counts them (attention's
    bmm aside): all dense weights, and of a mixture of experts only the top-k experts per token
    (a shared expert, DeepSeek-V3's dense first layer and Qwen2-MoE's shared expert included)."""
    import torch
    from archs import COMMON, hf_config, tiny_config
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.telemetry.flops import matmul_params

    # eager experts: one matmul per expert over the tokens routed to it (the grouped kernel is not counted)
    eager = {"experts_implementation": "eager", "attn_implementation": "eager"}
    config = hf_config(model_type, **eager) if extra is None else tiny_config(model_type) if extra == "tiny" else \
        AutoConfig.for_model(model_type, **COMMON, **extra, **eager)
    model = AutoModelForCausalLM.from_config(config).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(2, 300, (1, 40)), use_cache=False)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts.get("aten.mm", 0) + counts.get("aten.addmm", 0) == 2 * matmul_params(model)[0] * 40


def test_peak_flops_unknown_on_cpu_unless_overridden():
    import torch

    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "bf16") is None
    assert device_peak_flops(cpu, "fp32", override_tflops=2.0) == 2e12
    assert memory_stats(cpu)["mem_rss_peak_gib"] > 0


@pytest.mark.parametrize("platform, unit", [("linux", 1024), ("darwin", 1)])
def test_host_peak_memory_is_ru_maxrss_in_its_platforms_unit(monkeypatch, platform, unit):
    """ru_maxrss is KiB on Linux and bytes on macOS: a Mac's CPU run recorded 1024x its peak (and
    the max-batch sweep's budget went below 0)."""
    import resource
    import types

    import torch

    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=3 * 2**30 // unit))
    assert memory_stats(torch.device("cpu"))["mem_rss_peak_gib"] == 3


def test_a_resume_hides_the_steps_tensorboard_got_after_the_checkpoint(tmp_path):
    """An attempt logged steps 1-4 and left a checkpoint at step 2; its resume logs 3 and 4 again:
    TensorBoard shows each step once, the resumed values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for start, scale in ((0, 1.0), (2, 10.0)):
        t = Trackers(["tensorboard"], tmp_path, {}, "p", "r", start_step=start)
        for step in range(start + 1, 5):
            t.log({"loss": scale * step}, step)
        t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def _eventually(found, seconds: float = 30.0) -> bool:
    """W&B's writer is a process of its own: on a busy machine its last records reached the file a
    moment after run.finish() returned (once in the suite, under load)."""
    import time

    deadline = time.monotonic() + seconds
    while not found():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_trackers_write_offline(tmp_path, monkeypatch):
    from conftest import wandb_afresh

    wandb_afresh(monkeypatch)  # W&B's settings as this test sets them, whatever a test before it in this process set
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = {"train": {"lr": 0.1, "betas": [0.9, 0.95]}, "precision": "fp32"}
    t = Trackers(["tensorboard", "wandb", "mlflow"], tmp_path, config, "shardtune-test", "run1")
    for step in (1, 2):
        # log.watch's per-block norms beside the step's own grad_norm
        t.log({"step": step, "loss": 3.0 / step, "skipped": True, "note": "x", "grad_norm": 1.0,
               "grad_norm/h.0": 0.5}, step)
        t.histograms({"grad_hist/h.0": Histogram(-1.0, 1.0, [1.0, 0.0, 2.0, 1.0], 0.5, 1.5)}, step)  # not MLflow
    t.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert _eventually(lambda: any(b"grad_hist/h.0" in f.read_bytes() and b"histogram" in f.read_bytes()
                                   for f in (tmp_path / "wandb").rglob("*.wandb")))
    metric_files = list((tmp_path / "mlruns").rglob("metrics/loss"))
    assert metric_files and len(metric_files[0].read_text().splitlines()) == 2
    # MLflow's file store cannot hold a metric grad_norm (a file) and grad_norm/h.0 (a folder of that name)
    assert {f.name for f in (tmp_path / "mlruns").rglob("metrics/*") if f.is_file()} == \
        {"loss", "grad_norm", "grad_norm.h.0"}
    params = list((tmp_path / "mlruns").rglob("params/train.lr"))
    assert params and params[0].read_text().strip() == "0.1"


def test_missing_tracker_package_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(UserError, match=r"pip install 'shardtune\[wandb\]'"):
        Trackers(["wandb"], tmp_path, {}, "p", "r")


@pytest.mark.parametrize("tracker, env, words", [
    ("wandb", {"WANDB_MODE": "bogus"}, ["wandb could not start", "'online'", "WANDB_MODE"]),
    ("mlflow", {"MLFLOW_TRACKING_URI": "bogus://x"}, ["mlflow could not start", "bogus://x", "MLFLOW_TRACKING_URI"]),
])
def test_a_tracker_refusing_its_settings_is_a_one_line_error(tmp_path, monkeypatch, tracker, env, words):
    from conftest import wandb_afresh

    pytest.importorskip(tracker)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if tracker == "wandb":
        wandb_afresh(monkeypatch)  # wandb reads its WANDB_* settings once per process
    with pytest.raises(UserError) as caught:
        Trackers(["tensorboard", tracker], tmp_path, {"a": 1}, "p", "r")
    assert "\n" not in str(caught.value) and all(w in str(caught.value) for w in words), str(caught.value)


def _refused_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


@pytest.fixture
def answering_url():
    """A server that answers every request with 404 (answering at all is what counts)."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("tracker, env, fix", [
    ("mlflow", {"MLFLOW_TRACKING_URI": "{url}"}, "MLFLOW_TRACKING_URI"),
    ("wandb", {"WANDB_BASE_URL": "{url}", "WANDB_MODE": "online", "WANDB_API_KEY": "k" * 40}, "WANDB_MODE=offline"),
])
def test_a_tracker_server_that_does_not_answer_is_refused_before_the_run(monkeypatch, answering_url, tracker, env,
                                                                          fix):
    """The clients retry an unreachable server for minutes, after the model is built (MLflow ~4 min)."""
    from conftest import wandb_afresh
    from shardtune.telemetry.trackers import check_trackers

    pytest.importorskip(tracker)
    afresh = (lambda: wandb_afresh(monkeypatch)) if tracker == "wandb" else (lambda: None)
    url = _refused_url()
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(url=url))
    afresh()
    with pytest.raises(UserError) as caught:
        check_trackers(["tensorboard", tracker], timeout=2)
    assert url in str(caught.value) and fix in str(caught.value) and "\n" not in str(caught.value)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(url=answering_url))
    afresh()
    check_trackers([tracker], timeout=2)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///nowhere")
    monkeypatch.setenv("WANDB_BASE_URL", url)
    afresh()
    check_trackers([tracker], timeout=2)  # local: no server asked


def test_train_checks_the_trackers_before_it_builds_anything(assets, tmp_path, monkeypatch, capsys):
    from conftest import tiny_overrides
    from shardtune.cli.main import main

    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _refused_url())
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(assets, out), "log.trackers=[mlflow]"]) == 2
    assert "mlflow server" in capsys.readouterr().err
    assert not out.exists()


def _fake_run(folder, scale):
    folder.mkdir()
    rows = [{"step": 0, "eval_loss": 5.0, "eval_ppl": 148.4}]
    rows += [{"step": s, "loss": scale * 5 / s, "tokens_per_s": 1000.0 * s, "mem_rss_peak_gib": 1.5,
              "mfu": 0.1} for s in range(1, 11)]
    rows += [{"step": 10, "eval_loss": 2.0, "eval_ppl": 7.39}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize("again", ["{run}", "{run}/", "{run}/../run"])
def test_report_of_one_run_given_twice_is_one_line(tmp_path, capsys, again):
    """The same run twice was drawn as two runs (`run` and `run'`), as if they were two."""
    from shardtune.cli.main import main

    run = _fake_run(tmp_path / "run", 1.0)
    assert main(["report", str(run), again.format(run=run), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is given twice" in err[0] and not (tmp_path / "rep").exists()
    (tmp_path / "x").mkdir()
    other = _fake_run(tmp_path / "x" / "run", 0.5)  # the same name, another run: both drawn
    assert main(["report", str(run), str(other), "--out", str(tmp_path / "rep")]) == 0


def test_report_overlays_runs_and_summarizes(tmp_path):
    runs = [_fake_run(tmp_path / "a", 1.0), _fake_run(tmp_path / "b", 0.5)]
    report = write_report(runs, tmp_path / "report")
    text = report.read_text()
    assert "| a |" in text and "| b |" in text and "148.4" in text and "7.39" in text
    for stem in ("loss", "perplexity", "throughput", "memory", "mfu"):
        png = tmp_path / "report" / f"{stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({stem}.png)" in text
    assert not (tmp_path / "report" / "gpu.png").exists()  # nothing recorded, nothing drawn


SPEED_ROWS = [  # a start-up window, then 10 steps at 100 tok/s and 10 at 50: 200 tokens in 3 s
    {"step": 10, "tokens_per_s": 20.0, "step_time_s": 1.0, "mfu": 0.02},
    {"step": 15, "eval_loss": 2.0, "eval_ppl": 7.4},  # an evaluation between two windows
    {"step": 20, "tokens_per_s": 100.0, "step_time_s": 0.1, "mfu": 0.10},
    {"step": 30, "tokens_per_s": 50.0, "step_time_s": 0.2, "mfu": 0.05},
]


@pytest.mark.parametrize("skip", [1, 2])
def test_a_runs_speed_is_its_tokens_over_its_time(tmp_path, skip):
    """report and sweep give tokens/s as all the timed tokens over all the time (not the windows'
    mean rate, 75 here), MFU and GPU use likewise, the start-up window(s) left out."""
    from types import SimpleNamespace

    from shardtune.sweep.trial import _measurements
    from shardtune.telemetry.report import summarize

    rows = [dict(r, gpu_util=r["mfu"] * 5) if "mfu" in r else r for r in SPEED_ROWS]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = (200 / 3, 0.2 / 3) if skip == 1 else (50.0, 0.05)
    if skip == 1:
        summary = summarize("a", rows)
        assert summary["tokens/s"] == pytest.approx(want[0]) and summary["MFU"] == pytest.approx(want[1])
    got = _measurements(tmp_path, SimpleNamespace(device="cpu" if skip == 2 else "cuda", eval_steps=0))
    assert got["tokens_per_s"] == pytest.approx(want[0]) and got["mfu"] == pytest.approx(want[1])
    assert got["gpu_util"] == pytest.approx(5 * want[1])
    assert got["step_time_s"] == pytest.approx(0.15 if skip == 1 else 0.2)


def test_report_refuses_a_folder_without_metrics(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl"):
        write_report([tmp_path], tmp_path / "out")


def test_a_run_records_speed_memory_mfu_and_feeds_trackers_and_report(assets, tmp_path, monkeypatch):
    """End to end: metrics.jsonl holds the telemetry, TensorBoard gets the same points, and
    `shardtune report` draws the run."""
    from conftest import tiny_overrides
    from shardtune.cli.main import main
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    out = tmp_path / "run"
    run(load_config(None, tiny_overrides(assets, out, **{"train.max_steps": 4, "log.every_steps": 2,
                                                          "log.peak_tflops": 0.5, "log.live_memory": 1,
                                                          "log.trackers": "[tensorboard]",
                                                          "log.profile_steps": "[2,3]"}), defaults={}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for r in logged:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == r["tokens_per_s"]
        assert 0 <= r["data_wait_share"] < 1 and r["step_time_s"] > 0
        assert 0 < r["mfu"] < 1 and r["mem_rss_peak_gib"] > 0
    assert logged[-1]["tokens_seen"] == 4 * 8 * 64
    # live tensors of step 1 (log.live_memory=1): a small part of the process, none tracked later
    assert 0 < logged[0]["mem_live_peak_gib"] < logged[0]["mem_rss_peak_gib"] and "mem_live_peak_gib" not in logged[1]
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [2, 4]
    assert main(["report", str(out)]) == 0
    assert (out / "report" / "loss.png").is_file() and (out / "report" / "throughput.png").is_file()
    # log.profile_steps=[2,3]: a Chrome trace of exactly those two steps and the operator table
    trace = json.loads(gzip.open(out / "profile" / "trace.json.gz").read())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert "aten::mm" in names or "aten::addmm" in names
    table = (out / "profile" / "ops.txt").read_text()
    assert table.startswith("optimizer steps 2-3") and "aten::" in table and "Self CPU" in table


class _Rank:
    def __init__(self, rank: int, world_size: int):
        import torch

        self.rank, self.world_size, self.is_main, self.device = rank, world_size, rank == 0, torch.device("cpu")


@pytest.mark.parametrize("steps, done, total, rank, written", [
    ([3, 9], 0, 4, 0, "trace.json.gz"),  # the window ends with the run: its steps 3-4
    ([2, 3], 2, 6, 1, "trace-rank1.json.gz"),  # resumed at step 2: steps 3 only; per-rank names
    ([5, 6], 0, 4, 0, None),  # beyond the run: nothing, and a warning
])
def test_step_profiler_window(tmp_path, capsys, steps, done, total, rank, written):
    import torch

    from shardtune.telemetry.metrics import StepProfiler

    prof = StepProfiler(steps, done, total, _Rank(rank, 2 if rank else 1), tmp_path)
    x = torch.ones(8, 8)
    for _ in range(done, total):
        x = torch.mm(x, x) / 8
        prof.step()
    prof.close()
    files = sorted(p.name for p in (tmp_path / "profile").glob("*")) if written else []
    assert files == ([] if written is None else sorted([written, written.replace("trace", "ops")[:-8] + ".txt"]))
    if written is None:
        assert not (tmp_path / "profile").exists() and "nothing profiled" in capsys.readouterr().out
        return
    events = json.loads(gzip.open(tmp_path / "profile" / written).read())["traceEvents"]
    mms = [e for e in events if e.get("name") == "aten::mm"]
    first, last = max(steps[0], done + 1), min(steps[1], total)
    assert len(mms) == last - first + 1


def test_a_run_refused_at_its_start_does_not_block_its_retry(assets, tmp_path, monkeypatch, capsys):
    """A tracker refusing its settings stops the run after the output folder was claimed, before
    anything was logged: the retry into the same output_dir needs no --overwrite. A run that
    logged a step is still protected."""
    from conftest import tiny_overrides
    from shardtune.checkpoint.rundir import claim_output_dir
    from shardtune.cli.main import main

    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://x")  # no server to ask: refused by mlflow when it starts
    assert main(["train", *tiny_overrides(assets, out, **{"train.max_steps": 1}), "log.trackers=[mlflow]"]) == 2
    assert "mlflow could not start" in capsys.readouterr().err
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").stat().st_size == 0
    import torch.distributed

    assert not torch.distributed.is_initialized()  # a lone process's failed run ends its group: it can run again
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert main(["train", *tiny_overrides(assets, out, **{"train.max_steps": 1})]) == 0
    with pytest.raises(UserError, match="already holds a run"):
        claim_output_dir(out, overwrite=False, check_only=True)


def test_a_resume_continues_the_wandb_and_mlflow_runs_of_its_earlier_attempt(tmp_path, monkeypatch):
    """An attempt logged steps 1-4 and left a checkpoint at step 2; its resume continues the same
    W&B and MLflow runs (one run in their UI, as TensorBoard's one folder), and a fresh start in
    another folder starts new ones. A damaged id file starts new runs too."""
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def attempt(folder, start: int) -> dict:
        t = Trackers(["wandb", "mlflow"], folder, {"lr": 0.1}, "shardtune-test", "run1", start_step=start)
        for step in range(start + 1, 5):
            t.log({"loss": 1.0 / step}, step)
        t.close()
        return json.loads((folder / "trackers.json").read_text())

    first = attempt(tmp_path, 0)
    assert attempt(tmp_path, 2) == first  # resumed: the same runs
    offline = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(first["wandb"] in name for name in offline)  # each attempt a folder, one id
    runs = [p for p in (tmp_path / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
    assert [p.name for p in runs] == [first["mlflow"]]
    assert len((runs[0] / "metrics" / "loss").read_text().splitlines()) == 4 + 2  # steps 3-4 again
    other = tmp_path / "other"
    assert attempt(other, 0)["wandb"] != first["wandb"]  # a new run in a new folder
    (tmp_path / "trackers.json").write_text("{not json")
    assert attempt(tmp_path, 2)["mlflow"] != first["mlflow"]
