"""A training step's loss and gradient against transformers' own loss on the same global batch:
the token-weighted mean over every micro-batch of the optimizer step (not the mean of the
micro-batches' means, the gradient-accumulation bug HF Trainer had), whatever the rows' lengths."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, losses, make_trainer, spread_alpaca


@pytest.mark.parametrize("extra", [
    {"data.train_on_inputs": "true", "train.micro_batch_size": 1},  # unpadded rows, each of its own length
    {"train.micro_batch_size": 2},  # prompts without a loss, rows padded to the longest of their micro-batch
], ids=["inputs-one-row-each", "prompts-masked-padded"])
def test_a_step_is_the_token_mean_of_its_global_batch(assets, tmp_path, extra):
    from shardtune.model.hf import load_source_model

    trainer = make_trainer(assets, tmp_path, **{
        "model.config": json.dumps({**TINY["llama"], "max_position_embeddings": 256}), "data.format": "instruct",
        "data.path": str(spread_alpaca(tmp_path / "alpaca.jsonl", rows=16)), "data.seq_len": 256, "data.val_size": 0,
        "train.global_batch_size": 4, "train.max_steps": 1, "train.max_grad_norm": 0, **extra})
    grads = {}
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()}))
    plain = load_source_model(trainer.cfg.model, trainer.hf_config, trainer.cfg.train.seed)  # the same weights
    try:
        trainer.fit()
        batch = trainer.train_ds[trainer.plan.global_indices(0)]
    finally:
        trainer.close()
    # transformers' loss of each example alone (its mean over the tokens it predicts), weighted back to a sum
    total, tokens = 0.0, 0
    for ids, labels in zip(batch["input_ids"], batch.get("labels", batch["input_ids"]), strict=True):
        n = int((labels[1:] != -100).sum())
        total = total + plain(input_ids=ids[None], labels=labels[None]).loss * n
        tokens += n
    (total / tokens).backward()
    assert losses(tmp_path)[0] == pytest.approx(total.item() / tokens, abs=1e-5)
    assert grads.keys() == dict(plain.named_parameters()).keys()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
