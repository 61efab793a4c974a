"""shardtune vs transformers.Trainer: the same fine-tune, steady-state tokens/s and peak memory.

Both sides train the same random-init model on the same packed token blocks, in the same
order and split over ranks the same way, with the same AdamW settings, LR schedule, precision,
batch sizes and number of steps. Runs alternate (shardtune, HF, shardtune, HF, ...) so drift
on the machine hits both. The first --skip steps are left out of tokens/s.

    python bench/vs_hf_trainer.py                 # CPU: GPT-2 4x256 with GPT-2's vocabulary, 1 and 2 ranks
    python bench/vs_hf_trainer.py --setup cpu-vocab2048   # the same body, 2048-token vocabulary
    python bench/vs_hf_trainer.py --gpu           # GPU: Llama-shape ~1B, bf16, seq 2048
    python bench/vs_hf_trainer.py --setup gpu-opt # GPU: OPT-1.3B's shapes, bf16, seq 2048
    python bench/vs_hf_trainer.py --setup gpu-opt --rehearse   # that run's code path, tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TRAIN = {"lr": 1e-3, "lr_schedule": "cosine", "min_lr_ratio": 0.1, "warmup_steps": 3, "weight_decay": 0.01,
         "betas": [0.9, 0.95], "eps": 1e-8, "max_grad_norm": 1.0, "seed": 42}
SETUPS = {
    # GPT-2's own 50257-token vocabulary on a small body: the LM head and its logits weigh as they do
    # when fine-tuning GPT-2 (in GPT-2 small the logits of a micro-batch outweigh a layer's activations)
    "cpu": {"model": {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 256,
                      "vocab_size": 50257, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
            "seq_len": 256, "micro": 4, "global": 8, "steps": 12, "precision": "fp32",
            "nproc": [1, 2], "sharding": ["no_shard", "full_shard"], "target": 1.25},
    "gpu": {"model": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                      "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 5632,
                      "vocab_size": 32000, "max_position_embeddings": 2048},
            "seq_len": 2048, "micro": 4, "global": 32, "steps": 30, "precision": "bf16", "lr": 3e-4,
            "nproc": None, "sharding": ["full_shard", "no_shard"], "target": 1.3, "mfu_target": 0.5},
}
# OPT-1.3B (a reference system's model): its public config (facebook/opt-1.3b), random init, the
# GPU setup's batch and sequence. ~1.3B parameters, 9.0 GFLOP per token at seq 2048.
SETUPS["gpu-opt"] = {**SETUPS["gpu"], "model": {
    "model_type": "opt", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "ffn_dim": 8192,
    "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 2048, "do_layer_norm_before": True,
    "activation_function": "relu", "enable_bias": True, "dropout": 0.1, "attention_dropout": 0.0,
    "activation_dropout": 0.0}}
# --rehearse: a setup's code path at a tiny size on CPU (same architecture, precision and sides)
REHEARSAL = {"seq_len": 128, "micro": 2, "global": 4, "steps": 4}

# the first CPU setup (2026-11-22 runs 1-3): the quickstart's 2048-token vocabulary, a matmul-bound body
SETUPS["cpu-vocab2048"] = {**SETUPS["cpu"], "micro": 8, "global": 16, "steps": 20,
                           "model": {k: v for k, v in SETUPS["cpu"]["model"].items() if k != "vocab_size"}}
# the cpu setup on a CPU with bf16 instructions (AVX512-BF16/AMX), each side in its own bf16 mixed
# precision (shardtune: FSDP2 bf16 compute, fp32 master weights; HF: autocast)
SETUPS["cpu-bf16"] = {**SETUPS["cpu"], "precision": "bf16"}


def resolve_setup(name: str, steps: int | None, global_batch: int | None, rehearse: bool,
                  lr: float | None = None, warmup_steps: int | None = None) -> dict:
    """A setup with the command line's steps, global batch and learning-rate curve; rehearsing, shrunk
    (REHEARSAL)."""
    setup = dict(SETUPS[name])
    setup["steps"] = steps or setup["steps"]
    setup["global"] = global_batch or setup["global"]
    setup["lr"] = lr or setup.get("lr", TRAIN["lr"])
    setup["warmup_steps"] = TRAIN["warmup_steps"] if warmup_steps is None else warmup_steps
    if rehearse:
        setup.update(REHEARSAL, model=C.tiny_model(setup["model"]), steps=min(setup["steps"], REHEARSAL["steps"]))
    return setup


def shardtune_overrides(setup: dict, tokenizer: str, data_dir: str, out: Path, nproc: int, sharding: str) -> list[str]:
    tree = {"model": {"config": setup["model"], "tokenizer": tokenizer},
            "data": {"path": data_dir, "seq_len": setup["seq_len"]},
            "train": {**TRAIN, "lr": setup.get("lr", TRAIN["lr"]),
                      "warmup_steps": setup.get("warmup_steps", TRAIN["warmup_steps"]),
                      "micro_batch_size": setup["micro"], "global_batch_size": setup["global"],
                      "max_steps": setup["steps"]},
            "fsdp": {"sharding": sharding}, "precision": setup["precision"],
            "eval": {"at_start": False, "max_batches": 1}, "log": {"every_steps": 1, "progress": False},
            "output_dir": str(out)}
    return C.overrides_from(tree)


# ----------------------------------------------------------------------------- workers (one per rank)


def wall_clock_steps() -> list[float]:
    """Seconds from each step's end mark to the next's, filled as shardtune's StepMeter reads steps."""
    from shardtune.telemetry.metrics import StepMeter

    gaps, add = [], StepMeter.add

    def timed(meter, global_tokens, attention_pairs, data_seconds, began, done, *rest):
        if getattr(meter, "bench_last_done", None) is not None:
            gaps.append(meter.clock.seconds(meter.bench_last_done, done))
        meter.bench_last_done = done
        return add(meter, global_tokens, attention_pairs, data_seconds, began, done, *rest)

    StepMeter.add = timed
    return gaps


def worker_shardtune(spec: dict) -> None:

    from shardtune.config.load import load_config
    from shardtune.train.trainer import Trainer

    trainer = Trainer(load_config(None, spec["overrides"]), overwrite=True)
    plan, ds = trainer.plan, trainer.train_ds
    sums = []
    for step in range(trainer.total_steps):  # exactly the blocks train_step will see on this rank
        epoch, in_epoch = divmod(step, plan.steps_per_epoch)
        sums += [int(C.weighted_sums(ds[[int(i) for i in idx]]["input_ids"]))
                 for idx in plan.micro_batches(epoch, in_epoch)]
    ends = wall_clock_steps()
    rss_setup, cpu0, wall0 = C.current_rss_bytes(), time.process_time(), time.perf_counter()
    trainer.fit()
    util = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    rows = [json.loads(line) for line in (trainer.out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r or r.get("skipped")]  # a skipped step: loss None
    # shardtune's own CUDA memory log resets the peak at every log line: take the max over them too
    logged = max((r.get("mem_allocated_gib", 0) * 1024 ** 3 for r in rows), default=0)
    peak = max(C.peak_memory_bytes(trainer.dist.device.type), int(logged))
    record = {"peak_bytes": peak, "rss_setup": rss_setup, "sums": sums, "mode": f"FSDP2 {spec['sharding']}",
              "cpu_util": util}
    if trainer.dist.is_main:
        # from one step's end to the next's (the device's clock), as HF's side is timed: a gap where the
        # device waited for the host counts, as it does in HF's wall clock (the telemetry's own step_time_s
        # runs from a step's start mark, and leaves such a gap out); the first step from its start
        timed = [r.get("step_time_s") or spec["tokens_per_step"] / r["tokens_per_s"]
                 for r in rows if "tokens_per_s" in r]
        record["step_seconds"] = timed[:1] + ends[:len(timed) - 1] if len(ends) >= len(timed) - 1 else timed
        record["step_seconds_from_start_marks"] = timed  # what the run's own tokens/s and MFU count
        record["losses"] = [r["loss"] for r in rows]
        record["grad_norms"] = [r.get("grad_norm") for r in rows]
    C.write_rank_json(Path(spec["out"]), "shardtune", record)
    trainer.close()


def worker_hf(spec: dict) -> None:
    import datasets
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardtune.config.load import load_config
    from shardtune.distributed.fsdp import detect_block_class
    from shardtune.model.hf import load_hf_config, load_source_model, load_tokenizer
    from shardtune.train.optim import lr_factor

    cfg = load_config(None, spec["overrides"])
    t = cfg.train
    tokenizer = load_tokenizer(cfg.model)
    hf_config = load_hf_config(cfg.model)  # the same config, vocabulary and seeded init as shardtune
    if "vocab_size" not in cfg.model.config:
        hf_config.vocab_size = len(tokenizer)
    hf_config.bos_token_id, hf_config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    hf_config.pad_token_id = tokenizer.pad_token_id
    model = load_source_model(cfg.model, hf_config, t.seed)
    blocks = torch.load(spec["blocks"])
    train_ds = datasets.Dataset.from_dict({"input_ids": blocks.tolist(), "labels": blocks.tolist()})
    train_ds = train_ds.with_format("torch")

    world = spec["nproc"]
    fsdp = {}
    if spec["hf_fsdp"]:
        fsdp = {"fsdp": True,
                "fsdp_config": {"version": 2, "reshard_after_forward": True,
                                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                "transformer_layer_cls_to_wrap": [detect_block_class(model).__name__]}}
    args = TrainingArguments(
        output_dir=spec["out"] + "/hf", per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.global_batch_size // (t.micro_batch_size * world), max_steps=t.max_steps,
        learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1],
        adam_epsilon=t.eps, max_grad_norm=t.max_grad_norm, warmup_steps=t.warmup_steps,
        bf16=cfg.precision == "bf16", use_cpu=spec["device"] == "cpu", seed=t.seed,
        train_sampling_strategy="sequential", dataloader_drop_last=True, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        logging_nan_inf_filter=False,  # its default logs a NaN step's loss as a running mean (0 at every step)
        ddp_find_unused_parameters=False, **fsdp)  # HF's default True costs an extra graph walk

    class Timer(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available() and spec["device"] == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

    class SameRecipeTrainer(Trainer):
        """transformers.Trainer with shardtune's LR curve, recording which blocks each micro-step used."""

        sums: list = []

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda s: lr_factor(s, num_training_steps, t))
            return self.lr_scheduler

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.sums.append(C.weighted_sums(inputs["input_ids"]))
            return super().training_step(model, inputs, num_items_in_batch)

    timer = Timer()
    trainer = SameRecipeTrainer(model=model, args=args, train_dataset=train_ds, callbacks=[timer])
    rss_setup, cpu0, wall0 = C.current_rss_bytes(), time.process_time(), time.perf_counter()
    trainer.train()
    util = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    state = trainer.accelerator.state
    sharded = any(hasattr(p, "to_local") for p in trainer.model.parameters())
    mode = "FSDP2" if sharded else ("DDP" if world > 1 else "single process")
    ends = [timer.begin] + timer.ends
    record = {"peak_bytes": C.peak_memory_bytes(spec["device"]), "rss_setup": rss_setup, "mode": mode,
              "distributed_type": str(state.distributed_type), "cpu_util": util, "sums": [int(s) for s in trainer.sums],
              "step_seconds": [b - a for a, b in zip(ends, ends[1:])],
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h]}
    if spec["hf_fsdp"] and not sharded:
        record["fsdp_error"] = (f"TrainingArguments(fsdp=...) accepted, but accelerate ran {state.distributed_type} "
                                "with unsharded parameters (its FSDP plugin is only enabled for accelerator devices)")
    C.write_rank_json(Path(spec["out"]), "hf", record)


# ----------------------------------------------------------------------------- driver


def build_blocks(overrides: list[str], steps: int, path: Path) -> tuple[int, str]:
    """The packed blocks shardtune will train on, in the order it consumes them; returns the
    corpus's block count and a fingerprint of the blocks the run consumes, in order (two runs
    train on the same data exactly when it matches: a replay of a NaN needs that)."""
    import hashlib

    import torch

    from shardtune.config.load import load_config
    from shardtune.data import pipeline as data_lib
    from shardtune.data.batches import BatchPlan
    from shardtune.model.hf import load_tokenizer

    cfg = load_config(None, overrides)
    t = cfg.train
    train, _ = data_lib.prepare(cfg.data, load_tokenizer(cfg.model))
    plan = BatchPlan(len(train), t.global_batch_size, t.micro_batch_size, 1, 0, t.seed)
    order = [plan.order(e)[s * t.global_batch_size:(s + 1) * t.global_batch_size]
             for e, s in (divmod(step, plan.steps_per_epoch) for step in range(steps))]
    blocks = train[torch.cat(order).tolist()]["input_ids"]
    torch.save(blocks.clone(), path)
    return len(train), hashlib.sha256(blocks.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def run_side(side: str, spec: dict, workdir: Path) -> dict:
    fsdp = "-fsdp" if side == "hf" and spec["hf_fsdp"] else ""
    out = workdir / f"{side}-{spec['nproc']}-{spec['sharding']}-{spec['repeat']}{fsdp}"
    spec = {**spec, "out": str(out)}
    spec_path = workdir / f"{out.name}.json"
    spec_path.write_text(json.dumps(spec))
    load = os.getloadavg()[0]  # other work on the machine skews CPU numbers: keep it visible
    proc = C.torchrun(Path(__file__), spec["nproc"], ["--worker", side, "--spec", str(spec_path)])
    if proc.returncode != 0:
        return {"error": C.last_error_line(proc)}
    ranks = C.read_rank_json(out, side)
    main = next(r for r in ranks if "step_seconds" in r)
    steady = main["step_seconds"][spec["skip"]:]
    return {"tokens_per_s": spec["tokens_per_step"] * len(steady) / sum(steady), "peak_bytes": max(
        r["peak_bytes"] for r in ranks), "losses": main["losses"], "grad_norms": main.get("grad_norms"),
        "mode": main["mode"],
        "sums": [r["sums"] for r in ranks], "note": main.get("fsdp_error"), "load": load,
        "cpu_util": statistics.mean(r["cpu_util"] for r in ranks)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=sorted(SETUPS), default="cpu", help="which fine-tune (default: cpu)")
    p.add_argument("--gpu", action="store_true", help="a GPU setup (needs CUDA): --setup gpu (Llama ~1B, the default "
                   "with --gpu) or gpu-opt (OPT-1.3B)")
    p.add_argument("--repeats", type=int, default=2, help="shardtune/HF pairs per configuration")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: the setup's)")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of tokens/s")
    p.add_argument("--nproc", type=int, nargs="+", help="rank counts (default: CPU 1 2, GPU 1 and all GPUs)")
    p.add_argument("--sharding", nargs="+", choices=["no_shard", "full_shard"])
    p.add_argument("--lr", type=float, help="peak learning rate, both sides (default: the setup's)")
    p.add_argument("--warmup-steps", type=int,
                   help=f"linear warm-up steps, both sides (default: {TRAIN['warmup_steps']})")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the setup's)")
    p.add_argument("--budget-s", type=float, help="start no run that would end after this many seconds (judged by the "
                   "longest run so far); the table shows what ran")
    p.add_argument("--json", type=Path, help="also write the table and every run as JSON here (after each run)")
    p.add_argument("--rehearse", action="store_true", help="the setup's code path at a tiny size on CPU (2 layers "
                   "of 64, seq 128, 4 steps): checks a GPU run's plumbing without a GPU")
    p.add_argument("--peak-tflops", type=float, help="GPU peak bf16 TFLOPS for MFU (default: by GPU name)")
    p.add_argument("--workdir", type=Path, default=C.default_workdir() / "vs_hf")
    p.add_argument("--shardtune-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra shardtune override, e.g. compile=true (repeatable); HF runs unchanged")
    p.add_argument("--loss-tolerance", type=float, metavar="REL",
                   help="also compare the loss curves: every step of each pair finite on both sides and within REL "
                        "(relative) of HF's, else exit 1 (the GPU suite's curve stage: 0.03)")
    p.add_argument("--worker", choices=["shardtune", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        spec = json.loads(Path(a.spec).read_text())
        (worker_shardtune if a.worker == "shardtune" else worker_hf)(spec)
        return 0
    if C.args_only():
        return 0

    began = time.perf_counter()  # --budget-s counts the set-up too
    import torch

    a.gpu = a.gpu or a.setup.startswith("gpu")
    name = (a.setup if a.setup.startswith("gpu") else "gpu") if a.gpu else a.setup
    if a.gpu and not a.rehearse and not torch.cuda.is_available():
        print("error: --gpu needs a CUDA GPU and torch.cuda.is_available() is False here; "
              "run without --gpu for the CPU benchmark (or add --rehearse for its code path on CPU)", file=sys.stderr)
        return 2
    setup = resolve_setup(name, a.steps, a.global_batch, a.rehearse, a.lr, a.warmup_steps)
    if a.rehearse:
        a.skip = min(a.skip, setup["steps"] - 2)
    device = "cuda" if a.gpu and not a.rehearse else "cpu"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    nprocs = a.nproc or setup["nproc"] or sorted({1, max(gpus, 1)})
    shardings = a.sharding or setup["sharding"]
    a.workdir.mkdir(parents=True, exist_ok=True)
    assets = C.quickstart_assets()
    data_dir = str(Path(assets["train"]).parent)
    base = shardtune_overrides(setup, assets["tokenizer"], data_dir, a.workdir / "st", 1, "full_shard")
    blocks_path = a.workdir / "blocks.pt"
    n_blocks, fingerprint = build_blocks(base, setup["steps"], blocks_path)
    tokens_per_step = setup["global"] * setup["seq_len"]
    print(f"# shardtune vs transformers.Trainer ({name}{', rehearsal' if a.rehearse else ''} on {device})\n\n"
          f"{C.machine_line()}\n\n"
          f"model {json.dumps(setup['model'])} | seq {setup['seq_len']} | micro {setup['micro']} | "
          f"global {setup['global']} | {setup['steps']} steps (first {a.skip} not timed) | {setup['precision']} | "
          f"AdamW lr {setup['lr']} cosine warmup {setup['warmup_steps']} | "
          f"{n_blocks} packed blocks in the corpus (those trained on: sha256 {fingerprint}) | "
          f"{a.repeats} alternating pair(s) per row"
          + (f" | shardtune also {' '.join(a.shardtune_set)}" if a.shardtune_set else "") + "\n", flush=True)

    results, raw, walls = [], [], {"shardtune": 0.0, "hf": 0.0}
    fpt = C.flops_per_token(setup["model"], assets["tokenizer"], setup["seq_len"]) if a.gpu else None
    peak = None
    if a.gpu:  # shardtune's table of device peaks (TFLOP/s), or --peak-tflops
        from shardtune.telemetry.flops import device_peak_flops

        peak_flops = device_peak_flops(torch.device(device, 0), "bf16", a.peak_tflops)
        peak = peak_flops / 1e12 if peak_flops else None
    for nproc in nprocs:
        for sharding in shardings:
            if setup["global"] % (setup["micro"] * nproc):
                print(f"skipping {nproc} ranks: global batch {setup['global']} does not divide", flush=True)
                continue
            spec = {"nproc": nproc, "sharding": sharding, "device": device, "skip": a.skip,
                    "tokens_per_step": tokens_per_step, "blocks": str(blocks_path),
                    "overrides": shardtune_overrides(setup, assets["tokenizer"], data_dir,
                                                     a.workdir / f"run-{nproc}-{sharding}", nproc, sharding)
                    + a.shardtune_set}
            hf_fsdp = nproc > 1 and sharding == "full_shard"
            runs = {"shardtune": [], "hf": []}
            results.append((nproc, sharding, runs))
            for repeat in range(a.repeats):
                # a pair starts only if a pair as long as the longest so far still ends within the budget
                if a.budget_s and time.perf_counter() - began + sum(walls.values()) > a.budget_s:
                    print(f"  --budget-s {a.budget_s:g} reached: pair #{repeat} of {nproc} rank(s) {sharding} "
                          "not run", flush=True)
                    break
                for side in ("shardtune", "hf"):
                    t0 = time.perf_counter()
                    r = run_side(side, {**spec, "repeat": repeat, "hf_fsdp": hf_fsdp}, a.workdir)
                    if side == "hf" and hf_fsdp and "error" in r:  # FSDP refused: fall back to DDP, say so
                        note = r["error"]
                        r = run_side(side, {**spec, "repeat": repeat, "hf_fsdp": False}, a.workdir)
                        r["note"] = f"FSDP failed ({note}); ran DDP"
                    runs[side].append(r)
                    walls[side] = max(walls[side], time.perf_counter() - t0)
                    raw.append([nproc, sharding, side, repeat, f"{r.get('tokens_per_s', 0):.0f}",
                                f"{r.get('peak_bytes', 0) / C.MB:.0f}", f"{time.perf_counter() - t0:.0f}",
                                f"{r.get('load', 0):.1f}", f"{r.get('cpu_util', 0):.2f}",
                                r.get("error", r.get("mode", ""))])
                    print(f"  {nproc} rank(s) {sharding:10s} {side:9s} #{repeat}: "
                          f"{r.get('tokens_per_s', 0):8.0f} tok/s  peak {r.get('peak_bytes', 0) / C.MB:7.0f} MB  "
                          f"({time.perf_counter() - t0:.0f}s wall) {r.get('error', '')}", flush=True)
                    if a.json:  # what ran so far survives a kill
                        write_json(a.json, name, setup, device, *table(results, setup, fpt, peak), raw)

    headers, rows, notes = table(results, setup, fpt, peak)
    memory = "CUDA max_memory_allocated" if device == "cuda" else "peak RSS (ru_maxrss), max over ranks and repeats"
    print(f"\n## Results (median tokens/s over repeats; memory = {memory})\n")
    print(C.markdown_table(headers, rows))
    if notes:
        print("\nNotes:\n" + "\n".join(notes))
    print("\n## Runs in the order they ran\n")
    print(C.markdown_table(RAW_HEADERS, raw))
    if a.json:
        write_json(a.json, name, setup, device, headers, rows, notes, raw)
    if a.loss_tolerance is not None:
        return compare_curves(results, a.loss_tolerance)
    return 0


def compare_curves(results: list, tolerance: float) -> int:
    """Per-step losses and gradient norms of every pair side by side; 1 where a step is not finite
    on either side, or shardtune's loss is more than `tolerance` (relative) from HF's."""
    failed = False
    for nproc, sharding, runs in results:
        for repeat, (st, hf) in enumerate(zip(runs["shardtune"], runs["hf"])):
            print(f"\n## Loss curves: {nproc} rank(s) {sharding}, pair #{repeat} (tolerance {tolerance:.1%})\n")
            if "error" in st or "error" in hf:
                print(f"not compared: {st.get('error') or hf.get('error')}")
                failed = True
                continue
            rows, worst = [], 0.0
            for i, (a, b) in enumerate(zip(st["losses"], hf["losses"], strict=False)):
                ok = a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
                rel = abs(a - b) / abs(b) if ok else math.inf
                worst = max(worst, rel)
                norms = [(side.get("grad_norms") or [None] * (i + 1))[i] for side in (st, hf)]
                rows.append([i + 1, a, b, f"{rel:.2%}" + ("" if rel <= tolerance else " ❌"), *norms])
            short = len(st["losses"]) != len(hf["losses"])
            print(C.markdown_table(["step", "shardtune loss", "HF loss", "relative", "shardtune grad norm",
                                    "HF grad norm"], rows))
            verdict = worst <= tolerance and not short
            print(f"\nworst step {worst:.2%}{'; the sides ran different step counts' if short else ''}: "
                  f"{'✅' if verdict else '❌'}")
            failed = failed or not verdict
    return 1 if failed else 0


RAW_HEADERS = ["ranks", "sharding", "side", "repeat", "tok/s", "peak MB", "wall s", "load avg before",
               "CPU s/wall s per rank", "mode / error"]


def table(results: list, setup: dict, fpt: float | None, peak: float | None) -> tuple[list, list, list]:
    """The results table: one row per (ranks, sharding), medians over the pairs that ran."""
    target = setup["target"]
    headers = ["ranks", "sharding", "HF mode", "shardtune tok/s", "HF tok/s", f"ratio (target ≥ {target}×)",
               "shardtune peak MB", "HF peak MB", "peak ratio", "loss step 1 / last (st | HF)", "same blocks"]
    if fpt and peak:
        headers += [f"shardtune MFU (target ≥ {setup['mfu_target']:.0%})", "HF MFU"]
    rows, notes = [], []
    for nproc, sharding, runs in results:
        st, hf = runs["shardtune"], runs["hf"][:len(runs["shardtune"])]
        st = st[:len(hf)]  # whole pairs only
        if any("error" in r for r in st + hf):
            err = next(r["error"] for r in st + hf if "error" in r)
            rows.append([nproc, sharding, "error", "", "", "", "", "", "", err, ""])
            continue
        if not st:
            rows.append([nproc, sharding, "not run (--budget-s)", *[""] * (len(headers) - 3)])
            continue
        st_tps = statistics.median(r["tokens_per_s"] for r in st)
        hf_tps = statistics.median(r["tokens_per_s"] for r in hf)
        st_mem, hf_mem = max(r["peak_bytes"] for r in st), max(r["peak_bytes"] for r in hf)
        ratio = st_tps / hf_tps
        same = all(s["sums"] == h["sums"] for s, h in zip(st, hf))
        first_last = [f"{side[0]['losses'][0]:.3f}/{side[0]['losses'][-1]:.3f}" for side in (st, hf)]
        loss = " \\| ".join(first_last)
        row = [nproc, sharding, hf[0]["mode"], f"{st_tps:.0f}", f"{hf_tps:.0f}",
               f"{ratio:.2f}× {'✅' if ratio >= target else '❌'}", f"{st_mem / C.MB:.0f}", f"{hf_mem / C.MB:.0f}",
               f"{st_mem / hf_mem:.2f}", loss, "yes" if same else "NO"]
        if fpt and peak:
            mfu = [tps / nproc * fpt / (peak * 1e12) for tps in (st_tps, hf_tps)]
            row += [f"{mfu[0]:.1%} {'✅' if mfu[0] >= setup['mfu_target'] else '❌'}", f"{mfu[1]:.1%}"]
        rows.append(row)
        notes += [f"- {nproc} ranks {sharding}: {r['note']}" for r in hf[:1] if r.get("note")]
    return headers, rows, list(dict.fromkeys(notes))


def write_json(path: Path, name: str, setup: dict, device: str, headers, rows, notes, raw) -> None:
    path.write_text(json.dumps({"setup": name, "device": device, "config": setup,
                                "results": [dict(zip(headers, row)) for row in rows], "notes": notes,
                                "runs": [dict(zip(RAW_HEADERS, row)) for row in raw]}, indent=1))

if __name__ == "__main__":
    sys.exit(main())
