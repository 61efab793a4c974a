"""Next-token cross-entropy computed through the LM head in chunks of tokens, so the
(tokens x vocabulary) logits never exist in full: for GPT-2's 50k vocabulary and 2k tokens
per micro-batch that is 400 MB of fp32 logits, plus as much again for their gradient.

The gradients of the hidden states and of the head weight are produced chunk by chunk
during the forward pass (each chunk's logits are needed for both anyway) and handed to
autograd in backward, scaled by the incoming gradient. transformers calls the head with the
hidden states only, so the labels reach it through `head_labels`; every other call of the
head (generation, a plain forward) is the ordinary linear layer. With kernels=liger the same
head computes Liger-Kernel's fused linear cross-entropy instead (model/kernels.py): one of the
two per job, never both.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from shardtune.data.formats import IGNORE_INDEX
from shardtune.errors import UserError
from shardtune.families import config_value, family

# default chunk, in bytes of fp32 logits: on CPU small enough to stay in a typical L3 cache
# (passes over logits run ~4x faster there); on GPUs large enough for full-speed GEMMs
CHUNK_BYTES = {"cpu": 24 * 2 ** 20, "cuda": 64 * 2 ** 20}
# default chunks are a whole number of this many tokens: on CPU the logits are (vocabulary x
# chunk), and an odd row length (125 tokens for GPT-2's vocabulary) misaligns every row for the
# GEMMs and the softmax: a GPT-2 step took 1.12x the time of one with the model's own full-logits
# loss at 125 tokens, 0.89x at 128
CHUNK_ALIGN = 64


def chunk_tokens(setting: int | None, vocab_size: int, device_type: str) -> int:
    """Tokens per chunk: the configured number, or the whole number of CHUNK_ALIGN tokens
    nearest to what fits the device's CHUNK_BYTES."""
    if setting is not None:
        return setting
    budget = CHUNK_BYTES.get(device_type, CHUNK_BYTES["cuda"])
    fits = budget / (4 * vocab_size)
    return max(CHUNK_ALIGN, min(8192, CHUNK_ALIGN * round(fits / CHUNK_ALIGN)))


def head_loss(hidden, weight, labels, chunk: int, want_hidden_grad: bool, want_weight_grad: bool,
              accuracy: bool = False, vocab_first: bool | None = None):
    """(loss sum, number correct or None, d loss/d hidden, d loss/d weight) of `hidden` (N x d)
    against `labels` (N), one chunk of rows at a time. Logits and their softmax are fp32; the
    gradients keep the operands' dtype, except fp16, whose unscaled gradients would underflow."""

    # On CPU, MKL computes (vocab x tokens) logits ~1.5x faster than (tokens x vocab) for
    # these shapes, and the softmax over dim 0 stays vectorised; on CUDA, tokens first.
    if vocab_first is None:
        vocab_first = hidden.device.type == "cpu"
    dim = 0 if vocab_first else 1
    grad_dtype = torch.float32 if weight.dtype == torch.float16 else weight.dtype
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device) if accuracy else None
    d_hidden = torch.empty(hidden.shape, dtype=grad_dtype, device=hidden.device) if want_hidden_grad else None
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight_grad else None
    for start in range(0, hidden.size(0), chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        # one fused log-softmax pass gives the loss; exp of it, in place, the softmax. The logits
        # die with the pass, and each chunk's softmax before the next chunk's logits are made: at
        # most two chunks live at once (the logits and their log-softmax), never a third.
        logp = torch.log_softmax((weight @ h.t() if dim == 0 else h @ weight.t()).float(), dim=dim)
        valid = (y != IGNORE_INDEX).unsqueeze(dim)
        target = y.clamp(min=0).unsqueeze(dim)
        loss -= (logp.gather(dim, target) * valid).sum()
        if accuracy:
            correct += ((logp.argmax(dim, keepdim=True) == y.unsqueeze(dim)) & valid).sum()
        if not (want_hidden_grad or want_weight_grad):
            del logp
            continue
        # d loss / d logits = softmax - one_hot(target), zero on ignored positions
        probs = logp.exp_().scatter_add_(dim, target, torch.full_like(target, -1.0, dtype=logp.dtype))
        probs *= valid
        g = probs.to(weight.dtype)
        g_vocab_first = g if dim == 0 else g.t()  # V x c view either way
        if want_hidden_grad:
            d_hidden[start:start + chunk] = g_vocab_first.t() @ weight
        if want_weight_grad:
            if g.dtype == d_weight.dtype:
                d_weight.addmm_(g_vocab_first, h)  # no V x d temporary
            else:
                d_weight += (g_vocab_first @ h).float()
        del logp, probs, g, g_vocab_first
    if d_weight is not None:
        d_weight = d_weight.to(grad_dtype)
    return loss, correct, d_hidden, d_weight


@functools.cache
def _autograd_function():
    """The autograd.Function, built on first use (torch is imported lazily)."""

    class ChunkedHeadLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels, chunk):
            loss, _, d_hidden, d_weight = head_loss(hidden, weight, labels, chunk,
                                                    ctx.needs_input_grad[0], ctx.needs_input_grad[1])
            ctx.save_for_backward(d_hidden, d_weight)
            ctx.dtypes = hidden.dtype, weight.dtype
            return loss

        @staticmethod
        def backward(ctx, grad):
            d_hidden, d_weight = ctx.saved_tensors
            # scale in the saved dtype first (fp32 under fp16) so a loss-scaled gradient cannot underflow
            d_hidden = (d_hidden * grad).to(ctx.dtypes[0]) if d_hidden is not None else None
            d_weight = (d_weight * grad).to(ctx.dtypes[1]) if d_weight is not None else None
            return d_hidden, d_weight, None, None

    return ChunkedHeadLoss


def _head_forward(head, plain_forward, setting: int | None, kernels: str, hidden):
    request = head.__dict__.get("_shardtune_labels")
    if request is None:
        return plain_forward(hidden)

    labels, accuracy = request
    # k-bit preparation (QLoRA) keeps the head in fp32: meet its dtype, autograd casts back
    flat = hidden.reshape(-1, hidden.size(-1)).to(head.weight.dtype)
    if kernels == "liger":
        from shardtune.model.kernels import head_loss as liger_head_loss

        return liger_head_loss(flat, head.weight, labels, accuracy, IGNORE_INDEX)
    chunk = chunk_tokens(setting, head.out_features, hidden.device.type)
    if torch.is_grad_enabled() and (flat.requires_grad or head.weight.requires_grad):
        return _autograd_function().apply(flat, head.weight, labels, chunk)
    loss, correct, _, _ = head_loss(flat, head.weight, labels, chunk, False, False, accuracy)
    return torch.stack([loss, correct.float()]) if accuracy else loss


def install(model, setting: int | None, kernels: str = "none") -> bool:
    """Make the model's LM head compute the loss in chunks (kernels=liger: with Liger's fused
    linear cross-entropy) when `head_labels` is active. Returns False (and leaves the model alone)
    where that would not be the model's own loss: switched off (setting 0), a head with a bias or
    wrapped by an adapter, or a model type that transforms the logits after the head."""

    if is_installed(model):
        return True
    head = model.get_output_embeddings()
    known = family(getattr(model.config, "model_type", None))  # Family.plain_head: nothing after the head
    if setting == 0 or type(head) is not nn.Linear or head.bias is not None or not (known and known.plain_head):
        return False
    # an instance attribute: FSDP's hooks still wrap the call; parameter names are unchanged
    head.forward = functools.partial(_head_forward, head, head.forward, setting, kernels)
    head.__dict__["_shardtune_chunked"] = True
    return True


def is_installed(model) -> bool:
    head = model.get_output_embeddings()
    return head is not None and "_shardtune_chunked" in head.__dict__


@contextlib.contextmanager
def head_labels(model, labels, accuracy: bool = False):
    """While active, the model's forward returns the summed loss (and the number of correct
    predictions, with accuracy) in place of the logits. `labels` are already shifted: one per
    position, IGNORE_INDEX where nothing is predicted."""
    head = model.get_output_embeddings()
    head.__dict__["_shardtune_labels"] = (labels.reshape(-1), accuracy)
    try:
        yield
    finally:
        head.__dict__.pop("_shardtune_labels", None)


def router_loss(model, output):
    """A mixture-of-experts model's router load-balancing loss, exactly as its own loss adds it:
    `router_aux_loss_coef` times the `aux_loss` its forward computed from every layer's router
    logits (transformers' `load_balancing_loss_func` of that model), present when the config sets
    `output_router_logits`. None for other models. The model adds it once per forward to the mean
    token loss; the step adds it times the predicted tokens to the summed loss, so it is weighted
    by tokens across micro-batches and ranks like the token loss (one micro-batch: the model's loss)."""
    aux = getattr(output, "aux_loss", None)
    coef = config_value(model.config, "router_aux_loss_coef", kind=(int, float))
    if aux is None or not coef:
        return None
    if not isinstance(aux, torch.Tensor):  # e.g. transformers 5.17's granitemoe: no router logits, aux 0
        import transformers

        raise UserError(f"{model.config.model_type} in transformers {transformers.__version__} returns no router "
                        f"logits, so it computes no load-balancing loss (router_aux_loss_coef={coef}); upgrade "
                        "transformers, or set model.config.output_router_logits=false to train without it")
    return coef * aux.float()
