"""A training step's numbers against independent computations on the same global batch: the loss
and gradient against transformers' own loss of each document alone (the token-weighted mean over
every micro-batch of the optimizer step, not the mean of the micro-batches' means: the
gradient-accumulation bug HF Trainer had), the tokens and MFU against 6N x tokens + 12 x layers x
hidden x (query, key) pairs, whatever the rows' lengths and layout."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, losses, make_trainer, spread_alpaca

PEAK_TFLOPS = 0.5


@pytest.fixture(scope="module", params=[
    {"data.train_on_inputs": "true", "train.micro_batch_size": 1},  # unpadded rows, each of its own length
    {"train.micro_batch_size": 2},  # prompts without a loss, rows padded to the longest of their micro-batch
    {"train.micro_batch_size": 2, "data.padding_free": "true"},  # a micro-batch's examples in one row
    {"train.micro_batch_size": 2, "data.packing": "true", "data.seq_len": 128},  # document-masked blocks
], ids=["inputs-one-row-each", "prompts-masked-padded", "padding-free", "packed"])
def stepped(request, assets, tmp_path_factory):
    """One optimizer step (accumulation 4 or 2) of tiny Llama on instruct data: its metrics record, the
    gradients it applied (unclipped), its global batch, and transformers' model at the same weights."""
    from shardtune.model.hf import load_source_model

    out = tmp_path_factory.mktemp("step")
    trainer = make_trainer(assets, out, **{
        "model.config": json.dumps({**TINY["llama"], "max_position_embeddings": 256}), "data.format": "instruct",
        "data.path": str(spread_alpaca(out / "alpaca.jsonl", rows=24)), "data.seq_len": 256, "data.val_size": 0,
        "train.global_batch_size": 4, "train.max_steps": 1, "train.max_grad_norm": 0,
        "log.peak_tflops": PEAK_TFLOPS, **request.param})
    grads = {}
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()}))
    plain = load_source_model(trainer.cfg.model, trainer.hf_config, trainer.cfg.train.seed)  # the same weights
    try:
        trainer.fit()
        batch = trainer.train_ds[trainer.plan.global_indices(0)]
    finally:
        trainer.close()
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert losses(out)[0] == record["loss"]
    return record, grads, documents(batch), plain


def documents(batch: dict) -> list[tuple]:
    """(input_ids, labels) of every document of the batch's rows: a row, or its parts between
    restarts of its positions (packed blocks)."""
    out = []
    for row, ids in enumerate(batch["input_ids"]):
        labels = batch["labels"][row] if "labels" in batch else ids
        starts = [0, len(ids)]
        if "position_ids" in batch:
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [len(ids)]
        out += [(ids[a:b], labels[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return out


def test_loss_and_gradient_are_transformers_token_mean(stepped):
    record, grads, docs, plain = stepped
    # transformers' loss of each document alone (its mean over the tokens it predicts), weighted back to a sum
    total, tokens = 0.0, 0
    for ids, labels in docs:
        if n := int((labels[1:] != -100).sum()):
            total = total + plain(input_ids=ids[None], labels=labels[None]).loss * n
            tokens += n
    (total / tokens).backward()
    assert record["loss"] == pytest.approx(total.item() / tokens, abs=1e-5)
    assert grads.keys() == dict(plain.named_parameters()).keys()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_tokens_and_mfu_are_the_formulas_over_the_documents(stepped):
    """Padding is no token; a document of l tokens attends l x l (query, key) pairs, whatever else
    shares its row. MFU / tokens/s is the useful FLOPs per token (the step's time cancels)."""
    record, _, docs, plain = stepped
    weights = sum(p.numel() for n, p in plain.named_parameters() if p.ndim == 2 and "embed_tokens" not in n)
    layers, hidden = plain.config.num_hidden_layers, plain.config.hidden_size
    tokens = sum(len(ids) for ids, _ in docs)
    flops = 6 * weights * tokens + 12 * layers * hidden * sum(len(ids) ** 2 for ids, _ in docs)
    assert record["tokens_seen"] == tokens
    assert record["mfu"] * PEAK_TFLOPS * 1e12 / record["tokens_per_s"] == pytest.approx(flops / tokens, rel=1e-9)
