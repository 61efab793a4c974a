"""The math of one optimizer step and of evaluation: token losses, gradient accumulation,
clipping and the update. Everything a rank computes between two log lines is here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardtune.config.schema import RunConfig
from shardtune.data import docmask
from shardtune.data.batches import collate
from shardtune.data.formats import IGNORE_INDEX
from shardtune.distributed.collectives import all_sum, all_sum_on_device, stack_on_device
from shardtune.distributed.process_group import Dist
from shardtune.model import loss as loss_lib
from shardtune.model.prompt_learning import output_offset, virtual_tokens
from shardtune.telemetry.metrics import perplexity


def token_loss(model, batch, accuracy: bool = False, router: bool = False):
    """(sum of next-token losses, number of predicted tokens, number correct or None) of one
    micro-batch. With the chunked head loss installed (loss.install) the logits never exist in
    full; otherwise they do, and the argmax for accuracy costs one more pass (evaluation only).
    `router` (training): a mixture-of-experts model's load-balancing loss joins the sum, weighted
    by the micro-batch's predicted tokens (loss.router_loss), as the model's own loss has it."""

    # position t predicts token t+1; padding the labels (not slicing the logits) avoids a copy.
    # Prompt tuning's virtual tokens come first in the outputs: no labels there either.
    labels = F.pad(batch["labels"][:, 1:], (output_offset(model), 1), value=IGNORE_INDEX)
    mask = labels != IGNORE_INDEX
    count = mask.sum()
    inputs = docmask.model_inputs(model, batch)
    if loss_lib.is_installed(model):
        with loss_lib.head_labels(model, labels, accuracy):
            out = model(**inputs)  # the head returned the loss (and the number correct) as the logits
        loss_sum, correct = (out.logits[0], out.logits[1]) if accuracy else (out.logits, None)
    else:
        out = model(**inputs)
        logits = out.logits
        flat = logits.reshape(-1, logits.size(-1)).float()
        loss_sum = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & mask).sum() if accuracy else None
    extra = loss_lib.router_loss(model, out) if router else None
    if extra is not None:
        loss_sum = loss_sum + extra * count
    return loss_sum, count, correct


def evaluate(model, ds, batches, device, pad_id: int = 0, padding_free: bool = False) -> dict:
    """Token-weighted validation loss, perplexity and next-token accuracy over all ranks."""

    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for indices in batches:
            s, n, c = token_loss(model, collate(ds, indices, device, pad_id, padding_free), accuracy=True)
            loss_sum += s
            count += n
            correct += c
    model.train()
    loss_sum, count, correct = all_sum(loss_sum, count, correct, device=device)
    loss = loss_sum / max(count, 1)
    return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_acc": correct / max(count, 1)}


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # noqa: F821  this rank's summed token loss (device tensor, no sync)
    loss_tokens: torch.Tensor | float  # noqa: F821  tokens with a loss in the whole global batch
    input_tokens: torch.Tensor | int  # noqa: F821  tokens this rank fed the model (padding excluded)
    attention_pairs: torch.Tensor | int  # noqa: F821  (query, key) pairs of those tokens' attention (attention_pairs)
    virtual_tokens: int  # prompt tuning's learned inputs before this rank's rows: computed, no data's
    grad_norm: torch.Tensor  # noqa: F821
    watch: torch.Tensor | None = None  # noqa: F821  watch.Watch's per-block norms (device tensor), on a watch step
    grad_norms: GradNorms | None = None  # per parameter, for naming a non-finite one
    loss_scale: torch.Tensor | None = None  # noqa: F821  fp16: the grad scaler's scale after this step's update


@dataclass
class StepNumbers:
    """What the host reads of one optimizer step, the same on every rank."""

    loss: float  # mean token loss of the global batch
    input_tokens: float  # tokens all ranks fed the model
    attention_pairs: float  # their (query, key) pairs, all ranks'
    virtual_tokens: float  # prompt tuning's virtual inputs, all ranks'
    stop: bool  # a rank was asked to stop (signals.Preemption)
    grad_norm: float
    loss_scale: float  # 0 without a grad scaler


@dataclass
class HostCopy:
    """A device tensor the host reads later (a step's numbers, its watched norms: the loop reads a
    step once the next is queued). On CUDA a copy into page-locked host memory and an event are
    queued behind it now, and `result()` waits for that event: this step's work alone. A copy asked
    for at reading (`.tolist()` of the device tensor) is queued behind all work queued since, the
    next step's included: the host waited for that step to end, and the device idled while the host
    queued the one after, the very wait that reading one step late is for."""

    values: torch.Tensor
    copied: torch.cuda.Event | None = None

    @classmethod
    def queue(cls, t: torch.Tensor) -> HostCopy:
        if not t.is_cuda:
            return cls(t)
        copied = torch.cuda.Event()
        host = t.to("cpu", non_blocking=True)  # page-locked, filled when the work before it is done
        copied.record()
        return cls(host, copied)

    def result(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.values


def queue_numbers(out: StepResult, stop_requested: int, device) -> HostCopy:
    """A step's numbers in one device tensor, for `read_numbers` to take later: one small
    all-reduce (loss, input tokens, stop requests) is queued, and nothing waits for it. The loss scale
    is copied now: the scaler's own tensor changes with the next step, before the host reads this one."""
    summed = all_sum_on_device(out.loss_sum, out.input_tokens, out.attention_pairs, out.virtual_tokens,
                               stop_requested, device=device)
    scale = out.loss_scale if out.loss_scale is not None else 0
    return HostCopy.queue(torch.cat([summed, stack_on_device(out.loss_tokens, out.grad_norm, scale, device=device)]))


def read_numbers(numbers: HostCopy) -> StepNumbers:
    """The host's copy of `queue_numbers`' numbers: waits for that step's work to finish."""
    loss_sum, tokens, pairs, virtual, stop, loss_tokens, grad_norm, loss_scale = numbers.result().tolist()
    return StepNumbers(loss_sum / max(loss_tokens, 1.0), tokens, pairs, virtual, stop > 0, grad_norm, loss_scale)


def attention_pairs(batch: dict, virtual: int = 0, inputs: bool = False):
    """The (query, key) pairs attention computes for a collated batch (a 0-d device tensor): l² for
    every document of l tokens, what it computes alone. A row's documents are where its positions
    restart (position_ids), else the row is one, up to its padding (attention_mask); the positions
    0..l-1 of a document sum to l² as 1 + 3 + ... + (2l - 1). A prompt-learning model's `virtual`
    tokens before each row (one document: no document mask there) are keys for all its queries:
    prefix tuning's, l x (v + l); prompt tuning's (`inputs`) are queries too, (v + l)²."""
    ids = batch["input_ids"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    odd = 2 * positions + 1 + virtual * (2 if inputs else 1)
    if "attention_mask" in batch:
        odd = odd * batch["attention_mask"]
    return odd.sum() + (ids.size(0) * virtual ** 2 if inputs else 0)


def work(model, batches: list[dict]) -> tuple:
    """What `model` computes for these micro-batches, as MFU counts it (StepMeter): (the data's
    tokens, padding excluded; their attention's (query, key) pairs; prompt tuning's virtual tokens
    before every row, inputs as the data's are, but no data: tokens/s leaves them out)."""
    tokens = sum(b["attention_mask"].sum() if "attention_mask" in b else b["input_ids"].numel() for b in batches)
    virtual, as_inputs = virtual_tokens(model), output_offset(model) > 0
    pairs = sum(attention_pairs(b, virtual, as_inputs) for b in batches)
    return tokens, pairs, virtual * sum(b["input_ids"].size(0) for b in batches) if as_inputs else 0


def clip_gradients(model, max_grad_norm: float):
    """(the global gradient norm, GradNorms), the gradients clipped to `max_grad_norm` (0: not
    clipped). torch's clip_grad_norm_ computes each gradient's norm and drops them; kept here (one
    float per parameter, on the device), they name the parameters whose gradients are not finite
    when a step goes wrong (GradNorms.nonfinite), at no extra pass over the gradients and no host
    synchronisation on healthy steps."""

    params = [p for p in model.parameters() if p.requires_grad]
    present = [i for i, p in enumerate(params) if p.grad is not None]  # known on the host
    norms = torch.stack([n.float() for n in torch._foreach_norm([params[i].grad for i in present])]) if present \
        else torch.zeros(0)
    total = torch.linalg.vector_norm(norms)  # DTensors (partial norms) under FSDP, as in clip_grad_norm_
    if max_grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, total)
    local = norms.to_local() if hasattr(norms, "to_local") else norms
    return (total.full_tensor() if hasattr(total, "full_tensor") else total), GradNorms(present, local)


@dataclass
class GradNorms:
    """Each trained parameter's gradient norm on this rank (its shard's under FSDP), on the device."""

    positions: list[int]  # of these parameters among the model's trained ones, in model order
    norms: torch.Tensor  # noqa: F821

    def nonfinite(self, model, world_size: int) -> dict | None:
        """Which trained parameters of `model` have a gradient that is not finite on some rank:
        {"count", "first", "last", "block", "entry"} in model order (embeddings first, blocks in
        order, head last); None if none. Backward runs from the head down, so a NaN that arises in
        some block reaches every parameter before it: "last" lies in the block where it began, and
        "entry" names that block's non-finite parameters (which branch it came through).
        Collective where world_size > 1 (every rank reads the same non-finite step)."""
        bad = (~torch.isfinite(self.norms)).float()
        if world_size > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        hits = bad.nonzero().flatten().tolist()
        if not hits:
            return None
        trained = [name for name, p in model.named_parameters() if p.requires_grad]
        names = [trained[self.positions[i]] for i in hits]
        block = entry_block(names[-1])
        return {"count": len(hits), "first": names[0], "last": names[-1], "block": block,
                "entry": [n.removeprefix(f"{block}.") for n in names if n.startswith(f"{block}.")]}


def entry_block(name: str) -> str:
    """The decoder block (a numbered module in a list: `model.layers.3`) a parameter belongs to,
    else the parameter's own module (`lm_head`)."""
    parts = name.split(".")
    numbered = [i for i, part in enumerate(parts[:-1]) if part.isdigit()]
    return ".".join(parts[:numbered[-1] + 1] if numbered else parts[:-1]) or name


def train_step(model, optimizer, scaler, batches: list[dict], cfg: RunConfig, dist: Dist,
               count_tokens: bool = False, sync_each: bool = False, watch=None) -> StepResult:
    """One optimizer step over this rank's micro-batches (data.Prefetcher assembled them). The
    loss is normalised by the tokens of the whole global batch, so the gradient is the same
    whatever the world size and accumulation. `count_tokens`: the dataset is not equal blocks
    (data.packing.equal_blocks: some tokens get no loss, or rows have lengths of their own), so
    the tokens with a loss are counted; one decision for the whole dataset, the same on every rank
    (a batch's keys are not: a rank with a padded micro-batch would sum alone); `sync_each`: reduce
    gradients after every micro-batch (BuiltModel's policy); `watch`: a watch.Watch on the steps
    whose per-block gradient/parameter norms are wanted."""

    input_tokens, pairs, virtual = work(model, batches)
    if count_tokens:
        # counted and summed over ranks on the device: no host synchronisation before the forward
        global_tokens = sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in batches).double()
        if dist.world_size > 1:
            torch.distributed.all_reduce(global_tokens)
        scale = dist.world_size / global_tokens.clamp(min=1.0)
    else:  # packed blocks: every position but the first is predicted; no need to ask the others
        global_tokens = float(cfg.train.global_batch_size * (batches[0]["input_ids"].size(1) - 1))
        scale = dist.world_size / max(global_tokens, 1.0)
    # FSDP averages gradients over ranks; `scale` brings the result back to a sum over all tokens.
    loss_sum = torch.zeros((), device=dist.device)
    for i, batch in enumerate(batches):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP; a QLoRA model is not sharded
            model.set_requires_gradient_sync(sync_each or i == len(batches) - 1)
        s, _, _ = token_loss(model, batch, router=True)
        loss = s * scale
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += s.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grads = watch.grads() if watch is not None and "grad" in watch.kinds else None  # before clipping
    grad_norm, grad_norms = clip_gradients(model, cfg.train.max_grad_norm)
    # A NaN/inf update would poison every weight: it is skipped here, and fit() decides what next.
    loss_scale = None
    if scaler:
        scaler.step(optimizer)  # skips non-finite steps itself; asks the host (foreach kernels, see optim.py)
        scaler.update()
        loss_scale = scaler._get_scale_async()  # a device tensor (get_scale() would ask the host)
    elif optimizer.defaults.get("fused"):  # the fused kernel skips the update on the device: no host sync
        optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        optimizer.step()
    elif torch.isfinite(grad_norm):  # other kernels cannot: ask the host
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if watch is not None:
        watch = watch.finish(grads, watch.params_now() if "param" in watch.kinds else None)
    return StepResult(loss_sum, global_tokens, input_tokens, pairs, virtual, grad_norm, watch, grad_norms, loss_scale)
