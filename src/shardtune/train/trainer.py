"""The training loop, top to bottom: set up, then step / log / evaluate, then export."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed

from shardtune.check.run import CheckedRun, check_run
from shardtune.checkpoint.rundir import PREEMPTED_MARKER
from shardtune.config.load import dump_yaml
from shardtune.config.schema import RunConfig
from shardtune.data import batches as batching
from shardtune.data import chat
from shardtune.data import pipeline as data_lib
from shardtune.data.packing import equal_blocks
from shardtune.distributed.activation_memory import describe_memory_savers
from shardtune.distributed.collectives import all_max, broadcast_value, rank0_first, same_on_every_rank
from shardtune.distributed.fsdp import build_mesh
from shardtune.distributed.process_group import init_distributed
from shardtune.errors import EXIT_PREEMPTED
from shardtune.model import float8, kernels
from shardtune.model import loss as loss_lib
from shardtune.model.adapters import load_qlora_model
from shardtune.model.build import BuiltModel, ModelSpec, build_model
from shardtune.model.hf import count_params, load_generation_config, load_source_model
from shardtune.telemetry import flops
from shardtune.telemetry import metrics as telemetry
from shardtune.telemetry.trackers import flatten
from shardtune.train.optim import total_steps
from shardtune.train.resume import check_resume_data, data_record, resume_notes
from shardtune.train.state import LoopParts, QueuedStep, TrainState, seed_everything
from shardtune.train.step import HostCopy, evaluate, queue_numbers, read_numbers, train_step

HISTOGRAMS = "_histograms"  # a record's log.watch histograms, for the trackers only


class Trainer:
    """One rank's view of a run: `Trainer(checked)` builds it from the checked run (a resolved
    RunConfig is checked first), `fit()` trains and evaluates, `export()` writes final/,
    `close()` leaves the process group."""

    def __init__(self, run: CheckedRun | RunConfig, overwrite: bool = False):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # its padding/attention-mask advice does not apply to packed blocks
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()  # no retry chatter: a hub failure ends in one UserError line
        run = check_run(run) if isinstance(run, RunConfig) else run  # an in-process caller's resolved run
        self.cfg = cfg = run.cfg
        self.owns_group = not torch.distributed.is_initialized()
        self.dist = dist = init_distributed(cfg.device)
        if run.world_size != dist.world_size:
            raise ValueError(f"checked for {run.world_size} rank(s), running on {dist.world_size}")
        same_on_every_rank(dist, {k: v for k, v in flatten(cfg.to_dict()).items() if k != "output_dir"},
                           "set it on the command line (an auto is resolved on each rank's own machine), and give "
                           "every node the same recipe")
        # a default output_dir names the time: rank 0's, where torchrun's ranks resolved their own
        self.out = out = Path(broadcast_value(dist, cfg.output_dir))
        from shardtune.checkpoint.dcp import Checkpointer
        from shardtune.checkpoint.rundir import prepare_run_dir
        from shardtune.diskspace import checkpoint_bytes, space_warning
        from shardtune.publish.session import Publishing

        # Check the folder now, but change it (overwrite, trim, clean) only once all input is valid.
        resume_from = broadcast_value(dist, rank0_first(
            dist, lambda: prepare_run_dir(cfg, overwrite, check_only=True, out=out) if dist.is_main else None))

        # ---- data (rank 0 tokenizes first; the others hit the cache)
        self.tokenizer = tokenizer = run.tokenizer
        self.hf_config = hf_config = run.hf_config
        # what final/ and checkpoints say generation stops at and samples with (rank 0 writes them)
        self.generation_config = (load_generation_config(cfg.model.name_or_path, hf_config,
                                                         chat.trained_ends(cfg.data, tokenizer))
                                  if dist.is_main else None)
        self.accum = run.accum
        self.train_ds, self.val_ds = rank0_first(dist, lambda: data_lib.prepare(cfg.data, tokenizer,
                                                                                  cfg.train.global_batch_size))
        data_lib.same_on_every_rank(dist, {"training": self.train_ds, "validation": self.val_ds})
        t = cfg.train
        lengths = batching.sample_lengths(self.train_ds) if cfg.data.group_by_length else None
        self.plan = batching.BatchPlan(len(self.train_ds), t.global_batch_size, t.micro_batch_size,
                                       dist.world_size, dist.rank, t.seed, lengths=lengths)
        if resume_from:  # the same config may read changed files
            check_resume_data(resume_from, self.plan, self.train_ds)
        self.total_steps = total_steps(t, self.plan.steps_per_epoch)
        eval_mb = cfg.eval.micro_batch_size or t.micro_batch_size
        self.val_batches = batching.eval_batches(len(self.val_ds), eval_mb, dist.world_size, dist.rank,
                                                 cfg.eval.max_batches) if self.val_ds is not None else []

        self.built = self._build_model()
        self.model = model = self.built.model
        from shardtune.telemetry.trackers import HISTOGRAM_TRACKERS
        from shardtune.train.watch import Watch

        self.watch = Watch(model, self.built.block_cls, cfg.log.watch, cfg.log.watch_every, dist.device,
                           histograms=bool(HISTOGRAM_TRACKERS & set(cfg.log.trackers)))
        total, trainable = count_params(model)
        matmul, matmul_trainable = flops.matmul_params(model, cfg.data.seq_len)
        self.flops = flops.flops_rates(matmul, hf_config, cfg.data.seq_len, matmul_trainable,
                                           flops.backward_reach(model, self.built.block_cls, cfg.data.seq_len))
        self.say(f"model: {type(model).__name__.removeprefix('FSDP')} {total:,} params "
                 f"({trainable:,} trainable, {100 * trainable / max(total, 1):.3g}%) | "
                 f"{dist.world_size} rank(s) on {dist.device.type} | {cfg.fsdp.sharding} | {cfg.precision} | "
                 f"accumulation {self.accum} | {self.total_steps} steps | weights: {self.built.loaded}"
                 f"{float8.describe(model, cfg.float8, cfg.compile is True, cfg.activation_offload)}"
                 f"{kernels.describe(model, loss_lib.is_installed(model))}"
                 f"{describe_memory_savers(cfg, dist.device.type)}")

        from shardtune.checkpoint.dcp import ModelOptimizerState
        from shardtune.train.optim import build_grad_scaler, build_optimizer

        self.optimizer = build_optimizer(model, t, dist.device, cfg.precision, cfg.peft.lora_plus_ratio)
        float8.keep_scales_precomputed(model, self.optimizer, cfg.float8)
        self.scaler = build_grad_scaler(cfg.precision, dist.device)
        self.state = TrainState()
        tensors = ModelOptimizerState(model, self.optimizer, hf_config if cfg.checkpoint.hf_format else None)
        self.ckpt = Checkpointer(out / "checkpoints", cfg.checkpoint, tensors,
                                 {"train_state": self.state, **({"scaler": self.scaler} if self.scaler else {})},
                                 describe=self.describe, write_extras=self.write_checkpoint_extras,
                                 committed=lambda folder, step: self.publishing.committed(folder, step))
        # the checkpoint is input too: read whole before the folder changes (metrics trimmed, stale saves removed)
        meta = self.ckpt.load(resume_from) if resume_from else None
        notes = resume_notes(meta, t, self.state.step, self.total_steps, self.plan.steps_per_epoch, dist.world_size,
                             resume_from) if meta is not None else []
        rank0_first(dist, lambda: prepare_run_dir(cfg, overwrite, out=out) if dist.is_main else None)
        self.publishing = Publishing(cfg, out, run.publishes, dist.is_main, self.say, resuming=bool(resume_from))
        if note := space_warning(out / "checkpoints", cfg.checkpoint, checkpoint_bytes(model, dist.world_size),
                                 self.total_steps, self.plan.steps_per_epoch):
            self.say(note)
        for note in notes:
            self.say(note)
        if dist.is_main:
            (out / "config.yaml").write_text(dump_yaml(cfg))
            (out / PREEMPTED_MARKER).unlink(missing_ok=True)

    def _build_model(self) -> BuiltModel:
        """Skeleton on meta everywhere, sharded, then filled from rank 0's single copy."""
        cfg, dist, seed = self.cfg, self.dist, self.cfg.train.seed
        seed_everything(seed)
        if cfg.peft.quantize == "4bit":  # QLoRA: one GPU, the base quantized on load, not sharded
            from shardtune.model import loss as loss_lib

            model = load_qlora_model(cfg, self.hf_config, dist.device, dist.world_size, seed)
            loss_lib.install(model, cfg.loss_chunk_tokens)
            return BuiltModel(model.train(), None, [], reshard_after_forward=False, loaded="rank 0 (QLoRA)")
        folder = None
        if cfg.model.sharded_load and not cfg.model.random_init:
            from shardtune.model.hf_sharded_io import local_safetensors_folder

            folder = local_safetensors_folder(cfg.model.name_or_path)
        built = build_model(ModelSpec.of_run(cfg, self.hf_config), build_mesh(cfg.fsdp, dist), dist.device,
                            source=lambda: load_source_model(cfg.model, self.hf_config, seed), seed=seed,
                            folder=folder)
        built.model.train()
        return built

    def describe(self, step: int) -> dict:
        """What a checkpoint records beside the state objects: the run config and its data (a resume checks both)."""
        return {"epoch": step / self.plan.steps_per_epoch, "config": self.cfg.to_dict(),
                "data": data_record(self.cfg, self.plan, self.train_ds, step)}

    def write_checkpoint_extras(self, folder: Path) -> None:
        """The HF config and tokenizer beside the shards: export/eval/generate need nothing else. An
        hf_format checkpoint is a model folder other tools load as it is: its tokenizer goes beside
        the weights as well (AutoTokenizer.from_pretrained(checkpoints/step-N) found none)."""
        from shardtune.model.files import save_model_code

        self.hf_config.save_pretrained(folder)
        save_model_code(self.hf_config, folder)  # trust_remote_code: config.json names its modeling file
        self.generation_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder / "tokenizer")
        if self.cfg.checkpoint.hf_format:
            self.tokenizer.save_pretrained(folder)

    def say(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)

    def evaluate(self) -> dict:
        return evaluate(self.model, self.val_ds, self.val_batches, self.dist.device, self.tokenizer.pad_token_id or 0,
                        self.cfg.data.padding_free)

    def fit(self) -> dict:
        from shardtune.rank.host_memory import keep_freed_memory
        from shardtune.rank.preemption import Preemption
        from shardtune.telemetry.trackers import Trackers

        cfg, dist, t = self.cfg, self.dist, self.cfg.train
        log = telemetry.MetricsLog(self.out / "metrics.jsonl", dist.is_main)
        self.publishing.trackers = trackers = Trackers(cfg.log.trackers, self.out, cfg.to_dict(), cfg.log.project,
                                                       self.out.name, dist.is_main, cfg.publish.wandb_artifacts,
                                                       self.state.step)
        torch.manual_seed(t.seed + dist.rank)  # dropout: different masks per rank, reproducible per run
        self.ckpt.restore_rng(reseed=t.seed + 1_000_003 * self.state.step + dist.rank if self.state.step else None)
        results: dict = {}
        if self.val_batches and cfg.eval.at_start and self.state.step == 0:
            results["first"] = self.evaluate()
            record = {"step": 0, "epoch": 0.0, **results["first"]}
            log.write(record)
            trackers.log(record, 0)
            self.say(f"step 0: validation loss {results['first']['eval_loss']:.4f}, "
                     f"perplexity {results['first']['eval_ppl']:.2f}")
        if dist.device.type == "cpu":  # every step's tensors live in host memory: keep their pages mapped
            keep_freed_memory()
        start, first_step = time.perf_counter(), self.state.step
        parts = LoopParts(log, trackers,
                          telemetry.Progress(self.total_steps, self.state.step, dist.is_main, cfg.log.progress),
                          telemetry.GPUSampler(dist.device), Preemption(), self.prefetcher(),
                          telemetry.StepProfiler(cfg.log.profile_steps, self.state.step, self.total_steps, dist,
                                                 self.out))
        try:
            results["tokens"] = self._loop(parts, results)
        except BaseException as exc:
            trackers.close()  # else open until the final model is logged (publishing.final) or close()
            parts.preemption.stopped_with_a_peer(exc, dist.world_size)  # Ctrl-C twice: dies here, quietly
            raise
        finally:
            parts.close()
            self.ckpt.wait()
        elapsed = time.perf_counter() - start
        results["train_seconds"] = elapsed
        results["tokens_per_s"] = results["tokens"] / max(elapsed, 1e-9)
        if "first" in results and "last" in results:
            self.say(f"validation perplexity: {results['first']['eval_ppl']:.2f} before -> "
                     f"{results['last']['eval_ppl']:.2f} after training")
        self.say(f"trained {self.state.step - first_step} steps in {elapsed:.1f}s "
                 f"({results['tokens_per_s']:.0f} tokens/s)")
        return results

    def prefetcher(self) -> batching.Prefetcher:
        """This rank's micro-batches of every step from the current one on, one step ahead."""

        plan, cpu, pad_id = self.plan, torch.device("cpu"), self.tokenizer.pad_token_id or 0

        def assemble(step: int) -> list[dict]:
            epoch, in_epoch = divmod(step, plan.steps_per_epoch)
            return [batching.collate(self.train_ds, indices, cpu, pad_id, self.cfg.data.padding_free)
                    for indices in plan.micro_batches(epoch, in_epoch)]

        return batching.Prefetcher(assemble, self.dist.device, self.state.step, self.total_steps)

    def _loop(self, parts: LoopParts, results: dict) -> float:
        """Steps until done or preempted; returns the number of tokens trained on. The host reads
        a step's numbers one step late, once the next step's work is queued, so the device never
        waits for the host; evaluation, checkpoints, a stop and the last step read them at once."""
        from shardtune.train.optim import lr_at, set_lr

        cfg, dist, plan, state = self.cfg, self.dist, self.plan, self.state
        log, trackers, progress, gpu = parts.log, parts.trackers, parts.progress, parts.gpu
        preemption, prefetcher, profiler = parts.preemption, parts.prefetcher, parts.profiler
        clock = telemetry.StepClock(dist.device)
        meter = telemetry.StepMeter(dist.world_size, self.flops,
                          flops.device_peak_flops(dist.device, cfg.precision, cfg.log.peak_tflops), clock)
        live = telemetry.LiveMemory(self.model, self.optimizer, dist.device, cfg.log.live_memory)
        first_tokens = state.tokens_seen
        count_tokens = not equal_blocks(self.train_ds)
        queued: list[QueuedStep] = []
        while state.step < self.total_steps:
            began = clock.mark()  # the step's time starts here: evaluation and saves before it are none of it
            lr = lr_at(state.step, self.total_steps, cfg.train)
            set_lr(self.optimizer, lr)
            batches, data_seconds = prefetcher.take(state.step)
            with live.track():
                out = train_step(self.model, self.optimizer, self.scaler, batches, cfg, dist, count_tokens,
                                 sync_each=self.built.sync_grads_each_micro_step,
                                 watch=self.watch if self.watch.due(state.step + 1) else None)
            del batches
            state.step = step = state.step + 1
            # the global loss, tokens and whether any rank was asked to stop (all ranks stop at the
            # same step): one small all-reduce, queued behind the step
            numbers = queue_numbers(out, preemption.requested, dist.device)
            queued.append(QueuedStep(step, lr, data_seconds, numbers, began, clock.mark(),
                                     None if out.watch is None else HostCopy.queue(out.watch), out.grad_norms))
            profiler.step()  # after the mark: writing the trace is no step's time
            last = step == self.total_steps
            eval_now = bool(self.val_batches) and (last or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0))
            save_now = self.ckpt.due(step, plan.steps_per_epoch)
            records, stop = [], False
            while queued and (len(queued) > 1 or last or eval_now or save_now or stop):
                record, asked = self._read(queued.pop(0), meter, live, gpu, progress, save_now)
                records.append(record)
                stop = stop or asked
            if eval_now:
                results["last"] = self.evaluate()
                records[-1] = {"step": step, "epoch": step / plan.steps_per_epoch, **records[-1], **results["last"]}
                progress.write(f"step {step}: validation loss {results['last']['eval_loss']:.4f}, "
                               f"perplexity {results['last']['eval_ppl']:.2f}")
            for record in filter(None, records):
                histograms = record.pop(HISTOGRAMS, None)  # the trackers', not metrics.jsonl's
                log.write(record)
                trackers.log(record, record["step"])
                if histograms:
                    trackers.histograms(histograms, record["step"])
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
                break
            if save_now:
                self.ckpt.save(step)
        return state.tokens_seen - first_tokens

    def _read(self, queued: QueuedStep, meter, live, gpu, progress, save_now: bool) -> tuple[dict, bool]:
        """The host's look at a queued step (it waits for it): tokens seen, the metrics record when one
        is due (else {}), and whether any rank was asked to stop. A record is due every log.every_steps,
        at the last step, and where a run can resume from (a save `save_now` of this step, a stop): a
        resume starts a speed window there, so the one before ends there (`report` weighs a window by
        its steps), and a stop loses no step's numbers; and at a skipped update (non-finite, fp16 overflow)."""
        cfg, step = self.cfg, queued.step
        numbers = read_numbers(queued.numbers)
        self.state.tokens_seen += numbers.input_tokens
        meter.add(numbers.input_tokens, numbers.attention_pairs, queued.data_seconds, queued.began, queued.done,
                  numbers.virtual_tokens)
        epoch = step / self.plan.steps_per_epoch
        loss, grad_norm = numbers.loss, numbers.grad_norm
        nonfinite_step = not math.isfinite(loss) or (self.scaler is None and not math.isfinite(grad_norm))
        extra = {}  # the step's own: where a non-finite step came from, or the watched norms
        if nonfinite_step:  # on_nan=skip (stop raises)
            from shardtune.train import nonfinite

            extra = {"loss": None, "skipped": True, **({} if math.isfinite(grad_norm) else {"grad_norm": None}),
                       **nonfinite.met(self, step, loss, grad_norm, queued.grad_norms)}
        elif queued.watch is not None:
            extra = self.watch.record(watched := queued.watch.result())
            if self.dist.is_main and (histograms := self.watch.histograms_of(watched)):
                extra[HISTOGRAMS] = histograms
        resumable = numbers.stop or (save_now and step == self.state.step)
        # fp16: the grad scaler skipped this update (inf gradient at its scale) and lowers the scale;
        # recorded as skipped, as a non-finite step of on_nan=skip is, not as a step with grad_norm inf.
        # Either is a whole record, its speed window ended: one at a step a run resumes from was lost
        overflow = self.scaler is not None and not math.isfinite(grad_norm)
        if step % cfg.log.every_steps and step != self.total_steps and not (resumable or overflow or nonfinite_step):
            return ({"step": step, "epoch": epoch, **extra} if extra else {}), numbers.stop
        # each rank's own peaks: the record holds the fullest device's (the one that runs out first)
        memory = all_max({**telemetry.memory_stats(self.dist.device), **live.read()}, self.dist.device)
        record = {"step": step, "epoch": epoch, "loss": loss, "lr": queued.lr, "grad_norm": grad_norm,
                  "tokens_seen": self.state.tokens_seen, **meter.report(), **memory, **gpu.read(), **extra}
        if self.scaler:  # this step's, queued with it: the scaler's own is a later step's by now
            record["loss_scale"] = numbers.loss_scale
        if overflow:
            record["skipped"] = True
        if not nonfinite_step:
            progress.update(0, loss=loss, tok_s=record["tokens_per_s"])
        return record, numbers.stop

    def export(self, folder: Path | None = None) -> Path:
        """final/: a plain HF folder (a peft run's: its adapter), written whole or not at all."""
        from shardtune.checkpoint.final import save_final

        folder = folder or self.out / "final"
        how = save_final(self.model, self.cfg, self.hf_config, self.tokenizer, folder, self.dist.is_main,
                         self.generation_config, self.state.step)
        self.say(f"model saved to {folder}{f' ({how})' if how else ''}")
        return folder

    def close(self, code: int = 0) -> None:
        """The end of a run, in a fixed order: the checkpoint writer joined (and its group gone),
        every rank at one barrier, the launcher told the run completed with `code`, the group left."""
        from shardtune.rank.lifecycle import mark_completed

        self.publishing.close()
        self.ckpt.close()
        torch.distributed.barrier()
        mark_completed(code)
        if self.owns_group:
            torch.distributed.destroy_process_group()


def run(checked: CheckedRun | RunConfig, overwrite: bool = False) -> dict:
    """Train as one rank of the job: set up, fit, export final/, leave."""

    from shardtune.checkpoint.rundir import release_run_dir

    owns_group = not torch.distributed.is_initialized()
    trainer = None
    try:
        try:
            trainer = Trainer(checked, overwrite)
            results = trainer.fit()
            final = None
            if trainer.cfg.save_final and not results.get("preempted"):  # a preempted run is finished by its resume
                from shardtune.rank.preemption import held_through

                with held_through(str(trainer.out / "final")):
                    final = trainer.export()
            trainer.publishing.final(final, trainer.state.step, results)
        except BaseException:
            # No group is left behind a failed set-up, nor a lone process's (a notebook, a library caller
            # can run again); a failed fit with peers leaves it to the process's exit: a peer may still
            # wait in a collective.
            if owns_group and torch.distributed.is_initialized() and (
                    trainer is None or torch.distributed.get_world_size() == 1):
                torch.distributed.destroy_process_group()
            raise
        trainer.close(EXIT_PREEMPTED if results.get("preempted") else 0)
        return results
    finally:  # the output folder's lock (rank 0's, taken by prepare_run_dir)
        cfg = checked if isinstance(checked, RunConfig) else checked.cfg
        release_run_dir(trainer.out if trainer is not None else cfg.output_dir)
