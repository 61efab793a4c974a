"""log.watch: per-block gradient and parameter norms from the FSDP shards, checked against
torch's own norms of the whole tensors, asking the host nothing in the step, and in metrics.jsonl.
(2 ranks and hybrid sharding vs 1 process: tests/e2e/test_distributed.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from test_host_sync import HostReads

from conftest import make_trainer


@pytest.fixture
def trainer(assets, tmp_path):
    torch.set_num_threads(1)
    t = make_trainer(assets, tmp_path, **{"data.format": "text", "log.watch": "all", "log.watch_every": 1})
    yield t
    t.close()


def test_block_norms_equal_torchs_norms_and_ask_the_host_nothing(trainer, monkeypatch):
    from shardtune.train import step as step_mod

    watch = trainer.watch
    watch.histograms = True  # as with TensorBoard or W&B among log.trackers
    assert watch.names == ["embeddings", "layers.0", "layers.1", "head"]
    grads_seen = {}
    real_clip = step_mod.clip_gradients

    # torch's own norms of the whole gradients, read where the step clips them (it called torch's
    # clip_grad_norm_ once, which this test wrapped; since step.clip_gradients it saw no gradient)
    def clip(model, max_norm):
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads_seen[n] = torch.linalg.vector_norm(p.grad.full_tensor()).item()
        return real_clip(model, max_norm)

    monkeypatch.setattr(step_mod, "clip_gradients", clip)
    prefetcher = trainer.prefetcher()
    try:
        with HostReads() as reads:
            out = step_mod.train_step(trainer.model, trainer.optimizer, trainer.scaler, prefetcher.take(0)[0],
                                      trainer.cfg, trainer.dist, count_tokens=True, watch=watch)
        assert reads.ours == []
    finally:
        prefetcher.close()
    got = watch.record(out.watch)
    assert list(got) == watch.keys()

    def group_of(name: str) -> str:
        for g in watch.names[1:-1]:
            if f".{g}." in f".{name}":
                return g
        return "embeddings" if "embed" in name else "head"

    for kind, values in (("grad", grads_seen),
                         ("param", {n: torch.linalg.vector_norm(p.full_tensor()).item()
                                    for n, p in trainer.model.named_parameters()})):
        want = {}
        for name, norm in values.items():
            want[group_of(name)] = want.get(group_of(name), 0.0) + norm ** 2
        assert sorted(want) == sorted(watch.names), kind  # every block compared, none left out
        for g, sq in want.items():
            assert abs(got[f"{kind}_norm/{g}"] - sq ** 0.5) <= 1e-5 * max(1.0, sq ** 0.5), (kind, g)
    total = sum(got[f"grad_norm/{g}"] ** 2 for g in watch.names) ** 0.5
    assert abs(total - out.grad_norm.item()) < 1e-5 * max(1.0, total)  # clip_grad_norm_'s total

    # histograms: per block, torch.histc of the whole tensors over [-max|v|, max|v|]
    from shardtune.train.watch import BINS

    hists = watch.histograms_of(out.watch)
    assert sorted(hists) == sorted(f"{k}_hist/{g}" for k in ("grad", "param") for g in watch.names)
    params = {n: p.full_tensor().detach() for n, p in trainer.model.named_parameters()}
    for g in watch.names:
        whole = torch.cat([v.reshape(-1) for n, v in params.items() if group_of(n) == g])
        h = hists[f"param_hist/{g}"]
        assert h.high == pytest.approx(whole.abs().max().item()) and h.low == -h.high
        assert h.counts == torch.histc(whole, BINS, h.low, h.high).double().tolist(), g
        assert h.sum == pytest.approx(whole.double().sum().item(), abs=1e-6)
        assert h.sum_squares == pytest.approx(got[f"param_norm/{g}"] ** 2)
        assert sum(hists[f"grad_hist/{g}"].counts) == whole.numel()
        assert len(h.edges()) == BINS + 1


def test_watch_records_reach_metrics_jsonl(assets, tmp_path):
    from conftest import train_tiny

    train_tiny(assets, tmp_path, **{"train.max_steps": 4, "log.every_steps": 3, "log.watch": "gradients",
                                    "log.watch_every": 2, "eval.max_batches": 1,
                                    "log.trackers": ["tensorboard"]})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    watched = {r["step"]: r for r in rows if "grad_norm/h.0" in r}
    assert sorted(watched) == [2, 4] and not any("param_norm/h.0" in r for r in rows)
    assert all(r[k] > 0 for r in watched.values() for k in r if k.startswith("grad_norm/"))
    from shardtune.telemetry.report import write_report

    report = write_report([tmp_path], tmp_path / "report")
    assert (tmp_path / "report" / "grad_norms.png").stat().st_size > 0 and "grad_norms.png" in report.read_text()
    assert not (tmp_path / "report" / "param_norms.png").exists()
    assert not any("grad_hist/h.0" in r or "_histograms" in r for r in rows)  # the trackers' alone
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    assert "grad_hist/h.0" in events.Tags()["histograms"] and "param_hist/h.0" not in events.Tags()["histograms"]
    shown = events.Histograms("grad_hist/h.0")
    assert [e.step for e in shown] == [2, 4]
    assert all(e.histogram_value.num > 0 and sum(e.histogram_value.bucket) == e.histogram_value.num for e in shown)


@pytest.mark.parametrize("override, message", [("log.watch=weights", "log.watch"),
                                               ("log.watch_every=0", "log.watch_every=0 must be at least 1")])
def test_bad_watch_values_are_one_line(assets, tmp_path, capsys, override, message):
    from conftest import tiny_overrides
    from shardtune.cli.main import main

    assert main(["train", *tiny_overrides(assets, tmp_path), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
