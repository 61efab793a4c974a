"""The training loop, top to bottom: set up, then step / log / evaluate, then export."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from . import data as data_lib
from .config import RunConfig, check_world, dump_yaml
from .errors import UserError
from .launch import Dist, broadcast_value, init_distributed, rank0_first
from .model import build_meta_model, check_seq_len, count_params, load_hf_config, load_source_model, \
    load_tokenizer, materialize
from .parallel import apply_parallelism, build_mesh
from .rundir import default_output_dir
from .slurm import PREEMPTED_MARKER
from .telemetry import MetricsLog, Progress, Throughput, perplexity


def token_loss(model, batch):
    """(sum of next-token losses, number of predicted tokens, number correct) of one micro-batch."""
    import torch
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    flat = logits.reshape(-1, logits.size(-1)).float()
    loss_sum = F.cross_entropy(flat, labels.reshape(-1), ignore_index=data_lib.IGNORE_INDEX, reduction="sum")
    mask = labels != data_lib.IGNORE_INDEX
    correct = ((logits.argmax(-1) == labels) & mask).sum()
    return loss_sum, mask.sum(), correct


def all_sum(*values, device):
    import torch
    import torch.distributed as dist

    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def evaluate(model, ds, batches, device) -> dict:
    """Token-weighted validation loss, perplexity and next-token accuracy over all ranks."""
    import torch

    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for indices in batches:
            s, n, c = token_loss(model, data_lib.collate(ds, indices, device))
            loss_sum += s
            count += n
            correct += c
    model.train()
    loss_sum, count, correct = all_sum(loss_sum, count, correct, device=device)
    loss = loss_sum / max(count, 1)
    return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_acc": correct / max(count, 1)}


def train_step(model, optimizer, scaler, ds, micro_batches, cfg: RunConfig, dist: Dist):
    """One optimizer step over this rank's micro-batches. Returns (loss sum, tokens, grad norm)
    as device tensors; the loss is normalised by the tokens of the whole global batch, so the
    gradient is the same whatever the world size and accumulation."""
    import torch

    batches = [data_lib.collate(ds, idx, dist.device) for idx in micro_batches]
    local_tokens = sum((b["labels"][:, 1:] != data_lib.IGNORE_INDEX).sum() for b in batches)
    (global_tokens,) = all_sum(local_tokens, device=dist.device)
    # FSDP averages gradients over ranks; scale back up so the result is a sum over all tokens.
    scale = dist.world_size / max(global_tokens, 1.0)
    sync_each = cfg.fsdp.sharding in ("full_shard", "hybrid_shard")  # keep grads sharded between micro-steps
    loss_sum = torch.zeros((), device=dist.device)
    for i, batch in enumerate(batches):
        model.set_requires_gradient_sync(sync_each or i == len(batches) - 1)
        s, _, _ = token_loss(model, batch)
        loss = s * scale
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += s.detach()
    if scaler:
        scaler.unscale_(optimizer)
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if scaler:
        scaler.step(optimizer)  # skips non-finite steps itself
        scaler.update()
    elif torch.isfinite(grad_norm):  # a NaN/inf update would poison every weight; fit() decides what next
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, global_tokens, grad_norm


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """One rank's view of a run: `Trainer(cfg)` sets everything up, `fit()` trains and
    evaluates, `export()` writes final/, `close()` leaves the process group."""

    def __init__(self, cfg: RunConfig, overwrite: bool = False):
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # its padding/attention-mask advice does not apply to packed blocks
        self.cfg = cfg
        self.owns_group = not torch.distributed.is_initialized()
        self.dist = dist = init_distributed(cfg.device)
        cfg.output_dir = broadcast_value(dist, cfg.output_dir or default_output_dir(cfg.recipe))
        self.out = out = Path(cfg.output_dir)
        from .checkpoint import Checkpointer, prepare_run_dir

        # Check the folder now, but change it (overwrite, trim, clean) only once all input is valid.
        resume_from = broadcast_value(dist, rank0_first(
            dist, lambda: prepare_run_dir(cfg, overwrite, check_only=True) if dist.is_main else None))

        # ---- model config, tokenizer and data (rank 0 tokenizes first; the others hit the cache)
        self.tokenizer = tokenizer = load_tokenizer(cfg.model)
        self.hf_config = hf_config = load_hf_config(cfg.model)
        if cfg.model.name_or_path is None:  # random init: the tokenizer defines the vocabulary
            if "vocab_size" not in cfg.model.config:
                hf_config.vocab_size = len(tokenizer)
            hf_config.bos_token_id = tokenizer.bos_token_id
            hf_config.eos_token_id = tokenizer.eos_token_id
            hf_config.pad_token_id = tokenizer.pad_token_id
        if len(tokenizer) > hf_config.vocab_size:
            raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only {hf_config.vocab_size}; "
                            "use the model's own tokenizer or set model.config.vocab_size")
        check_seq_len(hf_config, cfg.data.seq_len)
        self.accum = check_world(cfg, dist.world_size)
        self.train_ds, self.val_ds = rank0_first(dist, lambda: data_lib.prepare(cfg.data, tokenizer, cfg.train.seed))
        t = cfg.train
        self.plan = data_lib.BatchPlan(len(self.train_ds), t.global_batch_size, t.micro_batch_size,
                                       dist.world_size, dist.rank, t.seed)
        self.total_steps = t.max_steps if t.max_steps > 0 else max(1, int(t.epochs * self.plan.steps_per_epoch))
        eval_mb = cfg.eval.micro_batch_size or t.micro_batch_size
        self.val_batches = data_lib.eval_batches(len(self.val_ds), eval_mb, dist.world_size, dist.rank,
                                                 cfg.eval.max_batches) if self.val_ds is not None else []

        # ---- model: skeleton on meta everywhere, sharded, then filled from rank 0's single copy
        seed_everything(t.seed)
        self.model = model = build_meta_model(hf_config, cfg.model.trust_remote_code)
        apply_parallelism(model, cfg, build_mesh(cfg, dist), dist.device)
        source = load_source_model(cfg.model, hf_config, t.seed) if dist.is_main else None
        materialize(model, source, dist.device, dist.is_main)
        del source
        model.train()
        total, trainable = count_params(model)
        self.say(f"model: {type(model).__name__.removeprefix('FSDP')} {total / 1e6:.2f}M params "
                 f"({trainable / 1e6:.2f}M trainable, {100 * trainable / max(total, 1):.1f}%) | "
                 f"{dist.world_size} rank(s) on {dist.device.type} | {cfg.fsdp.sharding} | {cfg.precision} | "
                 f"accumulation {self.accum} | {self.total_steps} steps")

        from .optim import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(model, t, dist.device)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, t)
        self.scaler = None
        if cfg.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=dist.device.type)
        self.step = 0
        rank0_first(dist, lambda: prepare_run_dir(cfg, overwrite) if dist.is_main else None)
        self.ckpt = Checkpointer(self)
        if resume_from:
            self.ckpt.load(resume_from)
        if dist.is_main:
            (out / "config.yaml").write_text(dump_yaml(cfg))
            (out / PREEMPTED_MARKER).unlink(missing_ok=True)

    def say(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)

    def evaluate(self) -> dict:
        return evaluate(self.model, self.val_ds, self.val_batches, self.dist.device)

    def fit(self) -> dict:
        import torch

        cfg, dist, plan, t = self.cfg, self.dist, self.plan, self.cfg.train
        log = MetricsLog(self.out / "metrics.jsonl", dist.is_main)
        torch.manual_seed(t.seed + dist.rank)  # dropout: different masks per rank, reproducible per run
        self.ckpt.restore_rng()
        results: dict = {}
        if self.val_batches and cfg.eval.at_start and self.step == 0:
            results["first"] = self.evaluate()
            log.write({"step": self.step, "epoch": self.step / plan.steps_per_epoch, **results["first"]})
            self.say(f"step {self.step}: validation loss {results['first']['eval_loss']:.4f}, "
                     f"perplexity {results['first']['eval_ppl']:.2f}")

        progress = Progress(self.total_steps, self.step, dist.is_main, cfg.log.progress)
        speed = Throughput()
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        start, first_step = time.perf_counter(), self.step
        from .signals import Preemption

        preemption = Preemption()
        try:
            self._loop(log, progress, speed, results, preemption)
        finally:
            preemption.restore()
            progress.close()
            log.close()
            self.ckpt.wait()
        elapsed = time.perf_counter() - start
        results["train_seconds"] = elapsed
        results["tokens_per_s"] = (self.step - first_step) * tokens_per_step / max(elapsed, 1e-9)
        if "first" in results and "last" in results:
            self.say(f"validation perplexity: {results['first']['eval_ppl']:.2f} before -> "
                     f"{results['last']['eval_ppl']:.2f} after training")
        self.say(f"trained {self.step - first_step} steps in {elapsed:.1f}s ({results['tokens_per_s']:.0f} tokens/s)")
        return results

    def _loop(self, log, progress, speed, results: dict, preemption) -> None:
        cfg, dist, plan, t = self.cfg, self.dist, self.plan, self.cfg.train
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        while self.step < self.total_steps:
            epoch, step_in_epoch = divmod(self.step, plan.steps_per_epoch)
            loss_sum, tokens, grad_norm = train_step(self.model, self.optimizer, self.scaler, self.train_ds,
                                                     plan.micro_batches(epoch, step_in_epoch), cfg, dist)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step = step = self.step + 1
            speed.add(tokens_per_step)
            loss_total, stop = all_sum(loss_sum, preemption.requested, device=dist.device)
            loss = loss_total / max(tokens, 1.0)
            record = {}
            last = step == self.total_steps
            bad = not math.isfinite(loss) or (self.scaler is None and not math.isfinite(float(grad_norm)))
            if bad:
                self.nonfinite(step, loss, float(grad_norm))
                record = {"step": step, "epoch": step / plan.steps_per_epoch, "loss": None, "skipped": True}
            elif step % cfg.log.every_steps == 0 or last:
                record = {"step": step, "epoch": step / plan.steps_per_epoch, "loss": loss, "lr": lr,
                          "grad_norm": float(grad_norm), "tokens_seen": step * tokens_per_step,
                          "tokens_per_s": speed.rate()}
                if self.scaler:
                    record["loss_scale"] = float(self.scaler.get_scale())
                progress.update(0, loss=loss, tok_s=record["tokens_per_s"])
            if self.val_batches and (last or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0)):
                results["last"] = self.evaluate()
                record = {"step": step, "epoch": step / plan.steps_per_epoch, **record, **results["last"]}
                progress.write(f"step {step}: validation loss {results['last']['eval_loss']:.4f}, "
                               f"perplexity {results['last']['eval_ppl']:.2f}")
            if record:
                log.write(record)
            progress.update(1)
            self.ckpt.poll()
            if stop and not last:
                folder = self.ckpt.save(step)
                self.ckpt.wait()
                results["preempted"] = True
                if dist.is_main:  # for job scripts that cannot see the ranks' exit code (torchrun)
                    (self.out / PREEMPTED_MARKER).write_text(f"{step}\n")
                progress.write(f"step {step}: got {preemption.name}; checkpoint saved to {folder}; "
                               "exiting for a requeue (resume=auto continues)")
                return
            if self.ckpt.due(step):
                self.ckpt.save(step)

    def nonfinite(self, step: int, loss: float, grad_norm: float) -> None:
        """A NaN/inf loss or gradient: the update was not applied (train_step); stop or go on."""
        what = f"loss {loss} / gradient norm {grad_norm} at step {step}"
        if self.cfg.on_nan == "skip":
            self.say(f"warning: {what}; skipped that update (on_nan=skip)")
            return
        self.ckpt.wait()
        from .checkpoint import find_latest

        good = find_latest(self.out / "checkpoints")
        where = f"the last good checkpoint is {good}" if good else "no checkpoint was written"
        raise UserError(f"{what}; stopped without applying it (on_nan=stop), {where}; lower train.lr "
                        "or set on_nan=skip")

    def export(self, folder: Path | None = None) -> Path:
        """Plain HF folder, gathered to rank 0's CPU only."""
        from .export import gather_full_state_dict, save_hf_folder

        folder = folder or self.out / "final"
        full = gather_full_state_dict(self.model)
        if self.dist.is_main:
            save_hf_folder(full, self.hf_config, self.tokenizer, folder)
        del full
        self.say(f"model saved to {folder}")
        return folder

    def close(self) -> None:
        import torch.distributed

        self.ckpt.close()
        torch.distributed.barrier()
        if self.owns_group:
            torch.distributed.destroy_process_group()


def run(cfg: RunConfig, overwrite: bool = False) -> dict:
    """Train as one rank of the job: set up, fit, export final/, leave."""
    import torch.distributed

    owns_group = not torch.distributed.is_initialized()
    try:
        trainer = Trainer(cfg, overwrite)
    except BaseException:
        if owns_group and torch.distributed.is_initialized():  # leave no group behind a failed set-up
            torch.distributed.destroy_process_group()
        raise
    results = trainer.fit()
    if not results.get("preempted"):  # a preempted run is finished by its resume
        trainer.export()
    trainer.close()
    return results
