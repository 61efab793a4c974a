"""Checks of a run config that need no model, data or process group: they run when the
config is loaded, before any work, so a bad value costs well under a second, not a tokenized
dataset. Checks that need the model or the data stay where those are."""

from __future__ import annotations

import dataclasses
import math
import re
import string

from shardtune.errors import UserError


def template_columns(template: str, key: str = "data.template") -> list[str]:
    """Column names a `str.format` template refers to ({a}, {a[0]}, {a.b} all name column a)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise UserError(f"{key}={template!r} is not a valid template ({exc}); name columns in braces "
                        "like {quote} and write literal braces as {{ }}") from None
    names = []
    for _, field, _, _ in parts:
        if field is None:
            continue
        name = re.match(r"[^.\[]*", field).group(0)
        if not name or name.isdigit():
            raise UserError(f"{key}={template!r} has a positional field {{{field}}}; name a column "
                            "instead, e.g. {text}")
        if name not in names:
            names.append(name)
    return names


def _floats(node, prefix: str = ""):
    """(key, value) of every float in the config tree, lists included."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from _floats(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, list):
            yield from ((key, v) for v in value if isinstance(v, float))


def _at_least(pairs) -> None:
    for key, value, least in pairs:
        if value < least:
            raise UserError(f"{key} must be at least {least}, got {value}")


def validate(cfg) -> None:
    """Every check of a RunConfig that needs only the config."""
    t, d, f, e, c, fr = cfg.train, cfg.data, cfg.fsdp, cfg.eval, cfg.checkpoint, cfg.freeze
    if cfg.model.name_or_path is None and not cfg.model.config:
        raise UserError("no model given; set model.name_or_path=<hub id or folder> "
                        "(or model.config={model_type: gpt2, ...} for a random-init model)")
    if d.path is None:
        raise UserError("no dataset given; set data.path=<hub id, file or folder>")
    for key, value in _floats(cfg):  # NaN passes every comparison below: refuse it first
        if not math.isfinite(value):
            raise UserError(f"{key}={value} is not a finite number; give a real value")
    _at_least([
        ("train.micro_batch_size", t.micro_batch_size, 1), ("train.global_batch_size", t.global_batch_size, 1),
        # a block of one token has nothing to predict: loss 0, perplexity 1, a wrong answer
        ("data.seq_len", d.seq_len, 2), ("log.every_steps", cfg.log.every_steps, 1),
        ("fsdp.min_num_params", f.min_num_params, 1), ("fsdp.forward_prefetch", f.forward_prefetch, 0),
        ("fsdp.backward_prefetch", f.backward_prefetch, 0), ("train.warmup_steps", t.warmup_steps, 0),
        ("train.weight_decay", t.weight_decay, 0), ("train.max_grad_norm", t.max_grad_norm, 0),
        ("train.min_lr_ratio", t.min_lr_ratio, 0), ("train.eps", t.eps, 0), ("eval.every_steps", e.every_steps, 0),
        ("eval.max_batches", e.max_batches, 0), ("data.val_size", d.val_size, 0),
        ("checkpoint.every_steps", c.every_steps, 0), ("checkpoint.keep_last", c.keep_last, 0),
        ("loss_chunk_tokens", cfg.loss_chunk_tokens or 0, 0), ("train.max_steps", t.max_steps, 0),
        ("train.epochs", t.epochs, 0), ("freeze.trainable_blocks", fr.trainable_blocks or 0, 0),
        ("log.live_memory", cfg.log.live_memory, 0), ("log.watch_every", cfg.log.watch_every, 1),
        ("publish.retries", cfg.publish.retries, 1), ("publish.wait_s", cfg.publish.wait_s, 0)])
    for key, value in [("eval.micro_batch_size", e.micro_batch_size), ("log.peak_tflops", cfg.log.peak_tflops),
                       ("fsdp.shard_size", f.shard_size), ("fsdp.replicate_size", f.replicate_size)]:
        if value is not None and value <= 0:
            raise UserError(f"{key} must be positive (or unset), got {value}")
    if t.global_batch_size % t.micro_batch_size:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                        f"train.micro_batch_size={t.micro_batch_size}; pick sizes that divide")
    if t.lr <= 0:
        raise UserError(f"train.lr must be positive, got {t.lr}")
    if t.min_lr_ratio > 1:
        raise UserError(f"train.min_lr_ratio={t.min_lr_ratio} would end the decay above the peak lr; "
                        "choose 0..1 (the final lr is lr x min_lr_ratio)")
    if t.max_steps == 0 and t.epochs == 0:
        raise UserError("set train.max_steps or train.epochs to a positive number")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise UserError(f"train.betas must be two numbers in [0, 1), got {t.betas}; e.g. train.betas=[0.9,0.95]")
    if d.start_idx is not None and d.end_idx is not None and d.end_idx <= d.start_idx:
        raise UserError(f"data.end_idx={d.end_idx} must be greater than data.start_idx={d.start_idx}")
    if cfg.resume == "auto" and not cfg.output_dir:
        raise UserError("resume=auto continues the run in output_dir; set output_dir=<that run's folder>")
    ps = cfg.log.profile_steps
    if ps is not None and (len(ps) != 2 or not 1 <= ps[0] <= ps[1]):
        raise UserError(f"log.profile_steps={ps} must be [first, last] optimizer steps with 1 <= first <= last; "
                        "e.g. log.profile_steps=[3,5] (a few steps: traces grow with every step)")
    _validate_format(d)
    _validate_adapters(cfg)
    _validate_publish(cfg)


def _validate_format(d) -> None:
    if d.format != "text" and not 2 <= d.example_cutoff <= d.seq_len:
        raise UserError(f"data.cutoff_len={d.cutoff_len} must be between 2 and data.seq_len={d.seq_len}; "
                        "lower it, or raise data.seq_len (the model's position limit is checked against seq_len)")
    if d.padding_free and (d.format == "text" or d.packing):
        raise UserError("data.padding_free lays unpacked instruct/chat examples end to end, but packed blocks have "
                        "no padding to remove; set data.padding_free=false (or data.packing=false)")
    if d.padding_free and d.document_mask is False:
        raise UserError("data.padding_free=true needs the document mask (examples laid end to end must not see each "
                        "other); drop data.document_mask=false")
    if d.template is not None:
        template_columns(d.template)


def _validate_adapters(cfg) -> None:
    p, fr, m = cfg.peft, cfg.freeze, cfg.model
    if p.method == "lora" and (fr.trainable_blocks is not None or fr.head_only or fr.embeddings):
        raise UserError("freeze.* does not combine with peft.method=lora (LoRA already freezes the base); "
                        "drop one of them")
    if fr.head_only and fr.trainable_blocks is not None:
        raise UserError("freeze.head_only and freeze.trainable_blocks exclude each other; set only one")
    if p.method == "lora" and (p.r < 1 or p.alpha <= 0 or not 0 <= p.dropout < 1):
        raise UserError(f"LoRA needs peft.r >= 1, peft.alpha > 0 and 0 <= peft.dropout < 1; got r={p.r}, "
                        f"alpha={p.alpha}, dropout={p.dropout}")
    if p.quantize != "none":
        if p.method != "lora":
            raise UserError("peft.quantize=4bit trains LoRA adapters on a frozen 4-bit base; set peft.method=lora")
        if cfg.device == "cpu":
            raise UserError("peft.quantize=4bit (QLoRA) needs a CUDA GPU and bitsandbytes; "
                            "on this machine use peft.quantize=none (plain LoRA)")
        if m.name_or_path is None or m.random_init:
            raise UserError("peft.quantize=4bit quantizes pretrained weights; set model.name_or_path and "
                            "model.random_init=false")


# the Hub's rule for a repo id: namespace/name, letters, digits, - _ . (no -- or .., no leading/trailing - or .)
REPO_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?")


def _validate_publish(cfg) -> None:
    p = cfg.publish
    if p.wandb_artifacts != "none" and "wandb" not in cfg.log.trackers:
        raise UserError(f"publish.wandb_artifacts={p.wandb_artifacts} logs to W&B; add log.trackers=[wandb] "
                        "or set publish.wandb_artifacts=none")
    if p.hub_repo is None:
        return
    if not REPO_ID.fullmatch(p.hub_repo) or "--" in p.hub_repo or ".." in p.hub_repo:
        raise UserError(f"publish.hub_repo={p.hub_repo!r} is not a Hub repo id; write namespace/name "
                        "(letters, digits, - _ .), e.g. publish.hub_repo=my-user/opt-arxiv")
    if not p.revision or p.revision.startswith(("/", "-")) or ".." in p.revision or " " in p.revision:
        raise UserError(f"publish.revision={p.revision!r} is not a branch name; e.g. publish.revision=main")
    if p.checkpoints and not (cfg.checkpoint.every_steps or cfg.checkpoint.at_epoch_end):
        raise UserError("publish.checkpoints uploads each checkpoint, but none are saved; set "
                        "checkpoint.every_steps=N (or publish.checkpoints=false for the final model only)")
