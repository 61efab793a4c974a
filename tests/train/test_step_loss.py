"""A training step's numbers against independent computations on the same global batch: the loss
and gradient against transformers' own loss of each document alone (the token-weighted mean over
every micro-batch of the optimizer step, not the mean of the micro-batches' means: the
gradient-accumulation bug HF Trainer had), the tokens and MFU against 6N x tokens + 12 x layers x
hidden x (query, key) pairs, whatever the rows' lengths and layout."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


class Rows:
    """Rows as the data pipeline's datasets hand them to collate: of their own lengths with labels,
    or (packed) blocks of one length, stacked, every position after the first predicted."""

    def __init__(self, ids: list, labels: list, packed: bool):
        self.ids, self.labels, self.packed = ids, labels, packed

    def __getitem__(self, indices):
        if self.packed:
            return {"input_ids": torch.stack([self.ids[i] for i in indices])}
        return {"input_ids": [self.ids[i] for i in indices], "labels": [self.labels[i] for i in indices]}


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = dict(TINY["llama"])
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_split_of_a_global_batch_clips_and_steps_as_one_batch(tiny_llama, one_rank, data):
    """A global batch of rows of any lengths and prompts (tokens without a loss), or of packed
    blocks (their tokens not counted: train_step's shortcut), cut into micro-batches of any size,
    padded or padding-free: the step's gradient norm is
    clip_grad_norm_'s over transformers' token-mean loss of the whole batch, and the gradient it
    applies is that gradient clipped once (per micro-batch, or of each micro-batch's mean, it is not);
    fp16's loss scale is taken off before the norm and the clipping."""
    from shardtune.config.schema import RunConfig, TrainConfig
    from shardtune.data.batches import collate
    from shardtune.distributed.process_group import Dist
    from shardtune.train.optim import build_grad_scaler
    from shardtune.train.step import train_step

    n = data.draw(st.integers(2, 6), "rows")
    packed = data.draw(st.booleans(), "packed")
    if packed:
        lengths, prompts = [data.draw(st.integers(2, 24), "block")] * n, [0] * n
    else:
        lengths = data.draw(st.lists(st.integers(2, 24), min_size=n, max_size=n), "lengths")
        prompts = [data.draw(st.integers(0, length - 1), "prompt") for length in lengths]  # 0 is never predicted
    micro = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]), "micro_batch_size")
    padding_free = data.draw(st.booleans(), "padding_free")
    max_norm = data.draw(st.sampled_from([0.0, 0.05, 1e3]), "max_grad_norm")
    scaler = build_grad_scaler(data.draw(st.sampled_from(["fp32", "fp16"]), "precision"), torch.device("cpu"))
    gen = torch.Generator().manual_seed(sum(lengths))
    ids = [torch.randint(0, 300, (length,), generator=gen) for length in lengths]
    labels = [torch.cat([torch.full((k,), -100), x[k:]]) for x, k in zip(ids, prompts, strict=True)]
    cfg = RunConfig(train=TrainConfig(global_batch_size=n, micro_batch_size=micro, max_grad_norm=max_norm))
    rows = Rows(ids, labels, packed)
    cpu = torch.device("cpu")
    batches = [collate(rows, list(range(s, s + micro)), cpu, 0, padding_free) for s in range(0, n, micro)]
    model, applied = tiny_llama, {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: every example sees the same model
    optimizer.register_step_pre_hook(lambda *_: applied.update({k: p.grad.clone()
                                                                for k, p in model.named_parameters()}))
    model.zero_grad(set_to_none=True)  # nothing left of an earlier example
    out = train_step(model, optimizer, scaler, batches, cfg, Dist(0, 1, 1, cpu), count_tokens=not packed)

    total, tokens = 0.0, 0
    for x, y in zip(ids, labels, strict=True):
        if count := int((y[1:] != -100).sum()):
            total = total + model(input_ids=x[None], labels=y[None]).loss * count
            tokens += count
    if not tokens:  # no row predicts a token: nothing to compare
        return
    (total / tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    assert out.loss_sum.item() / float(out.loss_tokens) == pytest.approx(total.item() / tokens, rel=1e-5)
    assert out.grad_norm.item() == pytest.approx(norm.item(), rel=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(applied[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
