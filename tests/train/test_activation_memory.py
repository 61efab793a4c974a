"""Selective and every-n-th-block checkpointing and activation offloading change no number: the
per-step losses equal those of a run without them (fp32, <= 1e-6)."""

from __future__ import annotations

import weakref

import pytest
import torch

from shardtune.distributed.activation_memory import save_matmuls_policy

VARIANTS = {"full": {"activation_checkpointing": "full"},
            "selective": {"activation_checkpointing": "selective"},
            "every_n": {"activation_checkpointing": "every_n", "activation_checkpointing_every": 2},
            "offload": {"activation_offload": "true"},
            "selective+offload": {"activation_checkpointing": "selective", "activation_offload": "true"}}


def test_checkpointing_kinds_and_offloading_give_the_same_losses(assets, tmp_path, monkeypatch):
    import torch.utils.checkpoint as ckpt
    import transformers.modeling_utils as hf_modeling

    from conftest import losses, tiny_overrides
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    torch.set_num_threads(1)
    recomputed = []  # each kind must really recompute (a no-op setting would pass the loss check)
    real = ckpt.checkpoint
    # transformers binds torch's checkpoint at its import: count the calls where it makes them
    monkeypatch.setattr(hf_modeling, "checkpoint", lambda fn, *a, **kw: recomputed.append(kw) or real(fn, *a, **kw))
    quiet = {"eval.at_start": "false", "train.max_steps": 3, "save_final": "false", "train.micro_batch_size": 4}
    run(load_config(None, tiny_overrides(assets, tmp_path / "none", **quiet)))
    ref = losses(tmp_path / "none")
    assert not recomputed
    for name, extra in VARIANTS.items():
        recomputed.clear()
        run(load_config(None, tiny_overrides(assets, tmp_path / name, **quiet, **extra)))
        got = losses(tmp_path / name)
        assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-6, (name, got, ref)
        per_step = len(recomputed) / (3 * 2)  # 2 micro-batches per step, TINY gpt2 has 2 blocks
        assert per_step == {"full": 2, "selective": 2, "every_n": 1}.get(name.split("+")[0], 0), (name, per_step)
        assert all(("context_fn" in kw) == name.startswith("selective") for kw in recomputed), name


def test_selective_policy_saves_matmuls_and_recomputes_pointwise_ops():
    from torch.utils.checkpoint import CheckpointPolicy

    policy, aten = save_matmuls_policy(), torch.ops.aten
    assert policy(None, aten.addmm.default) == policy(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.gelu.default) == policy(None, aten.native_layer_norm.default) == \
        CheckpointPolicy.PREFER_RECOMPUTE


def test_offload_moves_activations_but_no_parameter_nor_a_view_of_one(monkeypatch):
    """nn.Linear's matmul saves `weight.t()`, a view of the (gathered) parameter: moving it would
    copy every layer's weight to the host each step. The installed hooks ask `moves`, the rule
    the planner prices too, about every saved tensor."""
    from shardtune.distributed.activation_memory import ActivationOffload

    monkeypatch.setattr(ActivationOffload, "MIN_BYTES", 0)  # the tiny model's tensors are all small
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    offload = ActivationOffload(torch.device("cpu"), _Recorder())
    asked = []
    offload.moves = lambda t: asked.append((t, ActivationOffload.moves(offload, t))) or asked[-1][1]
    offload.install(model)
    model(torch.randn(4, 8)).square().sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    on_params = [moved for t, moved in asked if t.untyped_storage().data_ptr() in params]
    assert on_params and not any(on_params)  # the weights' views were saved, and none would move
    assert any(moved for _, moved in asked)  # activations would


class _Recorder:
    """ActivationOffload's copies on CPU, for real: the host copy is a clone and the device
    tensor is let go, so a wrong hand-back would change the gradients; every copy is logged.
    A copy out is done when `done_after` later packs have happened (None: only when waited for)."""

    def __init__(self, done_after=None):
        self.log, self.on_device, self.returned, self.done_after = [], 0, [], done_after
        self.most_brought_back = 0  # copies back not yet used, at most

    def takes(self, t):
        return True

    def to_host(self, t):
        self.log.append(("out", len([e for e in self.log if e[0] == "out"])))
        return (self.log[-1][1], t.detach().clone()), self.log[-1][1]

    def done(self, copied):
        outs = len([e for e in self.log if e[0] == "out"])
        return self.done_after is not None and outs - 1 - copied >= self.done_after

    def wait(self, copied):
        self.log.append(("wait", copied))

    def to_device(self, host, copied):
        index, data = host
        self.log.append(("in", index))
        self.on_device += 1
        self.most_brought_back = max(self.most_brought_back, self.on_device)
        return (index, data.clone()), None

    def ready(self, back, arrived):
        index, data = back
        self.log.append(("use", index))
        self.on_device -= 1
        self.returned.append(weakref.ref(data))
        return data

    def still_held(self) -> int:
        return sum(ref() is not None for ref in self.returned)


def _mlp_grads(offload=None, retain=False, between=lambda: None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(6)])
    if offload is not None:
        offload.install(model)
    loss = model(torch.randn(8, 16)).square().sum()
    loss.backward(retain_graph=retain)
    if retain:
        between()
        loss.backward()
    return [p.grad for p in model.parameters()]


def test_offload_bounds_copies_in_flight_and_prefetches_in_backwards_order(monkeypatch):
    """Forward keeps at most IN_FLIGHT_BYTES of saved tensors whose copy out is not known done
    (waiting for the oldest past it); backward takes those as they are, brings every other one
    back once, before its use, with the copies back of the `prefetch` saved before it already
    under way, never more than prefetch + 1 back and unused; the gradients equal a run without
    offloading, also when backward runs twice over one graph (retain_graph)."""
    from shardtune.distributed.activation_memory import ActivationOffload

    monkeypatch.setattr(ActivationOffload, "MIN_BYTES", 0)
    monkeypatch.setattr(ActivationOffload, "IN_FLIGHT_BYTES", 3 * 8 * 16 * 4)  # three activations
    plain = _mlp_grads()
    for prefetch, done_after in [(0, None), (1, None), (2, None), (3, None), (2, 1), (2, 0)]:
        copies = _Recorder(done_after)
        grads = _mlp_grads(ActivationOffload(torch.device("cpu"), copies, prefetch))
        assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
        moved = [i for kind, i in copies.log if kind == "out"]
        assert len(moved) >= 12  # each block saves its input and its GELU's input
        waited = [i for kind, i in copies.log if kind == "wait"]
        brought = [i for kind, i in copies.log if kind == "in"]
        used = [i for kind, i in copies.log if kind == "use"]
        kept = sorted(set(moved) - set(brought))  # still in flight when forward ended
        assert kept == moved[len(moved) - len(kept):] and len(kept) == {None: 3, 1: 1, 0: 0}[done_after], kept
        assert waited == (moved[:len(moved) - 3] if done_after is None else []), waited
        assert sorted(brought) == sorted(used) == moved[:len(moved) - len(kept)]  # each once
        for at, (kind, i) in enumerate(copies.log):
            if kind == "use":
                before = {j for k, j in copies.log[:at] if k == "in"}
                assert set(range(max(i - prefetch, 0), i + 1)) - set(used[:used.index(i)]) <= before, (prefetch, i)
        assert copies.most_brought_back == min(prefetch + 1, len(brought))
    copies = _Recorder()  # the graph and its host copies stay: what came back for backward does not
    twice = _mlp_grads(ActivationOffload(torch.device("cpu"), copies, 2), retain=True,
                       between=lambda: copies.still_held() == 0 or pytest.fail("device copies kept"))
    assert all(torch.equal(a, b) for a, b in zip(twice, _mlp_grads(retain=True), strict=True))
