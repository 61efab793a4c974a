"""Selective and every-n-th-block checkpointing and activation offloading change no number: the
per-step losses equal those of a run without them (fp32, <= 1e-6)."""

from __future__ import annotations

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
    copy every layer's weight to the host each step. The installed hooks (on CPU they move
    nothing) ask `moves`, the rule the planner prices too, about every saved tensor."""
    from shardtune.distributed.activation_memory import ActivationOffload

    monkeypatch.setattr(ActivationOffload, "MIN_BYTES", 0)  # the tiny model's tensors are all small
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    offload = ActivationOffload(torch.device("cpu"))
    asked = []
    offload.moves = lambda t: asked.append((t, ActivationOffload.moves(offload, t))) or asked[-1][1]
    offload.install(model)
    model(torch.randn(4, 8)).square().sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    on_params = [moved for t, moved in asked if t.untyped_storage().data_ptr() in params]
    assert on_params and not any(on_params)  # the weights' views were saved, and none would move
    assert any(moved for _, moved in asked)  # activations would
