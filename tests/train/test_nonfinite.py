"""A non-finite step says where it came from: which parameters' gradients went non-finite (how
many, the first and the last in model order) and the step's samples with their documents, in the
one-line error (on_nan=stop) and the metrics record (on_nan=skip); healthy steps ask the host
nothing for it (tests/train/test_host_sync.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import make_trainer
from shardtune.errors import UserError

POISONED_STEP = 2  # 1-based, as in metrics.jsonl
BLOCK1_NORMS = ["model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]


def plant_nan_below(trainer, step: int) -> None:
    """From optimizer step `step` on, the gradient leaving block 1's MLP down-projection for its
    input is NaN: every parameter before it in the model gets a NaN gradient, the down-projection
    itself and everything after it keep finite ones."""
    down = trainer.model.model.layers[1].mlp.down_proj
    calls = []

    def hook(module, grad_input, grad_output):
        calls.append(1)
        accum = trainer.plan.accum
        if (len(calls) - 1) // accum + 1 >= step:
            return (grad_input[0] * float("nan"),)
        return None

    down.register_full_backward_hook(hook)


def expected_origin(trainer) -> tuple[list[int], list[list[int]]]:
    samples = trainer.plan.global_indices(POISONED_STEP - 1)
    return samples, [list(trainer.train_ds.documents(i)) for i in samples]


def test_nan_names_parameters_and_samples_in_the_metrics(assets, tmp_path):
    trainer = make_trainer(assets, tmp_path, on_nan="skip", **{"train.max_steps": POISONED_STEP,
                                                              "eval.at_start": "false"})
    try:
        plant_nan_below(trainer, POISONED_STEP)
        trainer.fit()
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        row = next(r for r in rows if r.get("skipped"))
        assert row["step"] == POISONED_STEP
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        # everything the forward ran before the down-projection: earlier parameters in model order,
        # and block 1's two norms, which Llama declares after its MLP
        bad = names[:names.index("model.layers.1.mlp.down_proj.weight")] + BLOCK1_NORMS
        entry = [n.removeprefix("model.layers.1.") for n in bad if n.startswith("model.layers.1.")]
        assert row["nonfinite_grads"] == {"count": len(bad), "first": bad[0], "last": bad[-1],
                                          "block": "model.layers.1", "entry": entry}
        assert entry == ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                         "input_layernorm.weight", "post_attention_layernorm.weight"]
        samples, documents = expected_origin(trainer)
        assert row["samples"] == samples and row["documents"] == documents
        assert all(0 <= a <= b for a, b in documents)
    finally:
        trainer.close()


def test_nan_stop_names_them_in_one_line(assets, tmp_path):
    trainer = make_trainer(assets, tmp_path, **{"train.max_steps": POISONED_STEP + 1, "eval.at_start": "false"})
    try:
        plant_nan_below(trainer, POISONED_STEP)
        with pytest.raises(UserError) as err:
            trainer.fit()
        message = str(err.value)
        samples, documents = expected_origin(trainer)
        assert "\n" not in message and f"step {POISONED_STEP}" in message
        assert f"from model.embed_tokens.weight to {BLOCK1_NORMS[-1]} (model order), beginning in " \
               "model.layers.1 at self_attn.q_proj.weight, " in message
        first = f"{samples[0]} (document {documents[0][0]}" if documents[0][0] == documents[0][1] else \
            f"{samples[0]} (documents {documents[0][0]}-{documents[0][1]})"
        assert f"samples [{first}" in message
        assert all(torch.isfinite(p.full_tensor()).all() for p in trainer.model.parameters())  # not applied
    finally:
        trainer.close()


def test_healthy_gradients_name_nothing(one_rank):
    from shardtune.train.step import clip_gradients

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.ones(1, 3)).sum().backward()
    total, norms = clip_gradients(model, 0.0)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert torch.allclose(total, expected) and norms.nonfinite(model, 1) is None
    model[1].bias.grad[0] = float("inf")
    _, norms = clip_gradients(model, 1.0)
    assert norms.nonfinite(model, 1) == {"count": 1, "first": "1.bias", "last": "1.bias", "block": "1",
                                         "entry": ["bias"]}


@pytest.mark.parametrize(("name", "block"), [
    ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),
    ("base_model.model.model.layers.12.mlp.up_proj.lora_A.default.weight", "base_model.model.model.layers.12"),
    ("transformer.h.0.attn.c_attn.weight", "transformer.h.0"),
    ("lm_head.weight", "lm_head"),
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("bias", "bias"),
])
def test_the_entry_block_is_the_numbered_module_a_parameter_sits_in(name, block):
    from shardtune.train.step import entry_block

    assert entry_block(name) == block


def test_an_fp16_overflow_is_recorded_as_a_skipped_step(assets, tmp_path, monkeypatch):
    """fp16's grad scaler skips an update whose scaled gradient overflows: metrics.jsonl had it as a
    plain step with grad_norm inf (between log steps: not at all), the report nothing. Now it is
    marked as a skipped NaN step is, whatever log.every_steps, and the report counts it."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from shardtune.telemetry.report import read_metrics, summarize
    from shardtune.train import optim

    # fp16 gradients at a scale of 2**30 overflow; the scaler backs off to 2**10, where they do not
    monkeypatch.setattr(optim, "build_grad_scaler", lambda precision, device: ShardedGradScaler(
        device=device.type, init_scale=2.0**30, backoff_factor=2.0**-20))
    trainer = make_trainer(assets, tmp_path, precision="fp16", **{"train.max_steps": 4, "log.every_steps": 10,
                                                                  "eval.at_start": "false", "eval.every_steps": 0})
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r.get("skipped")) for r in rows if "loss" in r] == [(1, True), (4, None)]
    assert rows[0]["loss"] > 0 and not math.isfinite(rows[0]["grad_norm"]) and rows[0]["loss_scale"] == 2.0**10
    assert summarize("run", rows)["skipped steps"] == 1
