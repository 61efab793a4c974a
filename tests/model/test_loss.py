"""The chunked LM-head loss is the model's own loss: same value, same gradients, same accuracy,
in every precision, with frozen heads, and in a whole training run."""

from __future__ import annotations

import copy
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY
from shardtune.model import loss as loss_lib
from shardtune.train.step import token_loss


def tiny_model(arch: str, vocab: int = 300):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    spec = dict(TINY[arch], vocab_size=vocab)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    return AutoModelForCausalLM.from_config(config)


def batch(vocab: int = 300):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 21), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    labels[2, 15:] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_chunked_loss_gradients_and_accuracy_equal_the_plain_ones(arch):
    import torch

    plain = tiny_model(arch)
    chunked = copy.deepcopy(plain)
    assert loss_lib.install(chunked, 16) and loss_lib.is_installed(chunked)  # 63 rows: chunks of 16, 16, 16, 15
    b = batch()
    loss_p, n_p, _ = token_loss(plain, b)
    loss_c, n_c, _ = token_loss(chunked, b)
    assert int(n_p) == int(n_c) == 3 * 20 - 5 - 6  # predicted positions: 20 a row, less the masked ones
    expected = plain(input_ids=b["input_ids"], labels=b["labels"]).loss.item() * int(n_p)  # transformers' own
    assert loss_p.item() == pytest.approx(expected, rel=1e-6)
    assert loss_c.item() == pytest.approx(expected, rel=1e-6)
    loss_p.backward()
    (loss_c * 1.0).backward()  # a scaled upstream gradient goes through the saved gradients
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    with torch.no_grad():
        _, _, correct_p = token_loss(plain, b, accuracy=True)
        _, _, correct_c = token_loss(chunked, b, accuracy=True)
    assert int(correct_p) == int(correct_c)
    # outside token_loss the head is the plain linear layer (generation, a plain forward)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=b["input_ids"]).logits, chunked(input_ids=b["input_ids"]).logits)


def test_scaled_loss_and_a_frozen_head():
    """fp16's loss scaling multiplies the upstream gradient; a frozen head gets no gradient."""
    import torch

    plain = tiny_model("llama")
    chunked = copy.deepcopy(plain)
    for m in (plain, chunked):
        m.get_output_embeddings().weight.requires_grad_(False)
    loss_lib.install(chunked, 7)
    b = batch()
    (token_loss(plain, b)[0] * 1024.0).backward()
    (token_loss(chunked, b)[0] * 1024.0).backward()
    assert chunked.get_output_embeddings().weight.grad is None
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item()), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_heads_match_the_plain_loss(dtype):
    """Logits and softmax in fp32 as the plain path does after its upcast; gradients in the
    head's dtype (fp32 while unscaled under fp16)."""
    import torch

    plain = tiny_model("gpt2").to(getattr(torch, dtype))
    chunked = copy.deepcopy(plain)
    loss_lib.install(chunked, 10)
    b = batch()
    loss_p, _, _ = token_loss(plain, b)
    loss_c, _, _ = token_loss(chunked, b)
    assert loss_c.dtype == torch.float32
    assert loss_c.item() == pytest.approx(loss_p.item(), rel=2e-3)
    loss_p.backward()
    loss_c.backward()
    wp, wc = plain.get_output_embeddings().weight.grad, chunked.get_output_embeddings().weight.grad
    assert wc.dtype == wp.dtype
    assert (wc.float() - wp.float()).norm() / wp.float().norm() < 2e-2


def test_an_fp32_head_on_bf16_hidden_states():
    """After peft's k-bit preparation (QLoRA) the head is fp32 while the body may give bf16."""
    import torch

    model = tiny_model("llama")
    loss_lib.install(model, 8)
    hidden = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 300, (10,))
    with loss_lib.head_labels(model, labels):
        loss = model.get_output_embeddings()(hidden)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.grad.dtype == torch.float32


def test_install_leaves_what_it_cannot_prove_alone():
    import torch.nn as nn

    assert not loss_lib.install(tiny_model("gpt2"), 0)  # switched off
    model = tiny_model("gpt2")
    assert loss_lib.install(model, 16) and loss_lib.install(model, 16)  # twice is once
    assert not isinstance(model.get_output_embeddings().forward.args[1], functools.partial)
    model = tiny_model("gpt2")
    model.config.model_type = "gemma2"  # soft-caps its logits after the head
    assert not loss_lib.install(model, None) and not loss_lib.is_installed(model)
    model = tiny_model("llama")
    model.lm_head = nn.Linear(64, 300, bias=True)
    assert not loss_lib.install(model, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_logit_layouts_give_the_same_loss_and_gradients(dtype):
    """CPU computes (vocab x tokens) logits, CUDA (tokens x vocab): the same numbers either way."""
    import torch

    g = torch.Generator().manual_seed(3)
    dt = getattr(torch, dtype)
    hidden, weight = torch.randn(37, 16, generator=g).to(dt), (torch.randn(300, 16, generator=g) * 0.1).to(dt)
    labels = torch.randint(0, 300, (37,), generator=g)
    labels[[0, 5, 36]] = -100
    a = loss_lib.head_loss(hidden, weight, labels, 8, True, True, accuracy=True, vocab_first=True)
    b = loss_lib.head_loss(hidden, weight, labels, 8, True, True, accuracy=True, vocab_first=False)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert int(a[1]) == int(b[1])
    for x, y in zip((a[0], a[2], a[3]), (b[0], b[2], b[3]), strict=True):
        assert torch.allclose(x.float(), y.float(), rtol=tol, atol=tol)


def test_default_chunk_fits_the_device():
    """About 24 MB of fp32 logits on CPU (an L3 cache), 64 MB on CUDA, in whole multiples of 64
    tokens; an explicit size wins."""
    assert loss_lib.chunk_tokens(None, 50257, "cpu") == 128  # 125 fit: rounded to 64s
    assert loss_lib.chunk_tokens(None, 50257, "cuda") == 320  # 333
    assert loss_lib.chunk_tokens(None, 32000, "cuda") == 512  # 524
    assert loss_lib.chunk_tokens(None, 300, "cpu") == 8192  # capped
    assert loss_lib.chunk_tokens(None, 10 ** 6, "cpu") == 64  # at least one aligned chunk
    assert loss_lib.chunk_tokens(5, 50257, "cpu") == 5


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(2, 2 ** 21), device=st.sampled_from(["cpu", "cuda", "mps"]))
def test_default_chunk_is_aligned_and_near_its_budget(vocab, device):
    """Whatever the vocabulary: a multiple of 64 tokens (an odd chunk misaligns every row of the
    logits: 12 % slower steps on CPU), and within half an alignment step of the byte budget."""
    tokens = loss_lib.chunk_tokens(None, vocab, device)
    assert tokens % loss_lib.CHUNK_ALIGN == 0 and 64 <= tokens <= 8192
    fits = loss_lib.CHUNK_BYTES.get(device, loss_lib.CHUNK_BYTES["cuda"]) / (4 * vocab)
    assert tokens in (64, 8192) or abs(tokens - fits) <= loss_lib.CHUNK_ALIGN / 2


def test_training_with_and_without_chunks_is_the_same_run(assets, tmp_path):
    from conftest import train_tiny as train

    chunked = train(assets, tmp_path / "chunked", **{"train.max_steps": 4, "loss_chunk_tokens": 50})
    plain = train(assets, tmp_path / "plain", **{"train.max_steps": 4, "loss_chunk_tokens": 0})
    assert max(abs(a - b) for a, b in zip(chunked, plain, strict=True)) < 1e-5, (chunked, plain)


def test_a_router_loss_the_model_did_not_compute_is_refused_in_one_line():
    """transformers 5.17's GraniteMoE returns no router logits and an aux loss of plain 0: training
    would silently go without the load-balancing loss the config asks for."""
    from types import SimpleNamespace

    import torch

    from shardtune.errors import UserError
    from shardtune.model.loss import router_loss

    model = SimpleNamespace(config=SimpleNamespace(model_type="granitemoe", router_aux_loss_coef=0.01))
    with pytest.raises(UserError, match="returns no router logits.*output_router_logits=false") as refused:
        router_loss(model, SimpleNamespace(aux_loss=0))
    assert "\n" not in str(refused.value)
    assert router_loss(model, SimpleNamespace(aux_loss=None)) is None
    assert float(router_loss(model, SimpleNamespace(aux_loss=torch.tensor(2.0)))) == pytest.approx(0.02)


@pytest.mark.parametrize("grads", [True, False])
def test_at_most_two_chunks_of_logits_live_at_once(grads):
    """Each chunk's logits and softmax are freed before the next chunk's logits are made: the
    loss holds two chunks at most (the logits and their log-softmax), not the previous chunk's
    softmax as a third (issue 36: a step held one chunk more at two or more chunks than at one,
    so the planner's micro-batch extrapolation was over by a chunk)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    vocab, width, tokens, chunk = 4096, 16, 64, 16  # four chunks of 256 KiB of fp32 logits
    hidden, weight = torch.randn(tokens, width), torch.randn(vocab, width)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = MemTracker()
    tracker.track_external(hidden, weight, labels)
    with tracker:
        _, _, d_hidden, d_weight = loss_lib.head_loss(hidden, weight, labels, chunk, grads, grads)
        before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]  # inputs and the gradients
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    chunk_bytes = 4 * vocab * chunk
    assert 1.9 * chunk_bytes < peak - before <= 2.1 * chunk_bytes, (peak - before) / chunk_bytes
