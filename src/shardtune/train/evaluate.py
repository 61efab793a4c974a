"""`shardtune eval` and `shardtune generate`: a trained model, from an HF folder (or hub id),
a run folder, or a sharded checkpoint.

eval shards the model with FSDP like training does (rank 0 holds the one full copy while it is
handed out), so it runs on 1 or N ranks and gives the same numbers: token-weighted loss,
perplexity and next-token accuracy. generate runs in one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as tdist

from shardtune.checkpoint.loading import load_model
from shardtune.errors import UserError
from shardtune.model.hf import max_positions

# ----------------------------------------------------------------------------- eval


def eval_blocks(args, run_cfg, tokenizer):
    """Packed blocks to evaluate on: --data's split, else the validation split the run of
    `run_cfg` (the evaluated checkpoint's) used, tokenized with `tokenizer`."""
    from shardtune.config.schema import DataConfig
    from shardtune.data import pipeline as data_lib

    if args.data is None:
        if run_cfg is None:
            raise UserError(f"{args.model!r} is not a shardtune checkpoint, so it has no dataset; pass --data PATH")
        d = run_cfg.data
        if args.seq_len:
            d.seq_len = args.seq_len
        if args.split is None:
            _, val = data_lib.prepare(d, tokenizer, run_cfg.train.seed)
            if val is None:
                raise UserError("the run had no validation split; pass --data PATH [--split NAME]")
            return val
        cfg = d
    else:
        cfg = DataConfig(path=args.data, name=args.data_name, text_field=args.text_field,
                         seq_len=args.seq_len or (run_cfg.data.seq_len if run_cfg else 512))
    splits = data_lib.load_documents(cfg)
    split = args.split or next((s for s in ("validation", "test") if s in splits), "train")
    if split not in splits:
        raise UserError(f"dataset {cfg.path!r} has no split {split!r}; choose --split from {', '.join(splits)}")
    # the run's format (instruct, chat, template) when it is the run's data; packed text otherwise
    blocks = data_lib.tokenize_split(splits[split], cfg, tokenizer, f"dataset {cfg.path!r}")
    if len(blocks) == 0:
        raise UserError(f"split {split!r} of {cfg.path!r} has fewer tokens than one block of {cfg.seq_len}; "
                        "lower --seq-len")
    return blocks.with_format("torch")


def eval_one(spec: str, args, dist, data_cfg) -> dict:
    """Metrics of one model over all ranks (collective), on the data that `data_cfg` (the run
    config of the evaluated checkpoint, or None) and args select."""
    from shardtune.data import pipeline as data_lib
    from shardtune.distributed.collectives import rank0_first
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.model.hf import check_seq_len
    from shardtune.train.step import evaluate

    # Rank 0 alone reads the full weights; the other ranks only the config and tokenizer.
    source, tokenizer, hf_config, run_cfg = rank0_first(dist, lambda: load_model(spec, weights=dist.is_main))
    ds = rank0_first(dist, lambda: eval_blocks(args, data_cfg, tokenizer))
    check_seq_len(hf_config, len(ds[0]["input_ids"]))
    # fp32, full_shard: evaluation needs none of the run's training settings
    layout = ModelSpec(hf_config, loss_chunk_tokens=run_cfg.loss_chunk_tokens if run_cfg else None,
                       trust_remote_code=bool(run_cfg and run_cfg.model.trust_remote_code))
    held = [source]  # popped by build_model: rank 0's full copy is freed once it is handed out
    del source
    model = build_model(layout, build_mesh(layout.fsdp, dist), dist.device, source=held.pop).model
    batches = data_lib.eval_batches(len(ds), args.micro_batch_size, dist.world_size, dist.rank, args.max_batches)
    metrics = evaluate(model, ds, batches, dist.device)
    metrics["sequences"] = sum(1 for b in batches for i in b if i >= 0)
    if dist.world_size > 1:
        from shardtune.distributed.collectives import all_sum

        (metrics["sequences"],) = all_sum(metrics["sequences"], device=dist.device)
    metrics["sequences"] = int(metrics["sequences"])
    return metrics


def run_eval(args) -> dict:
    """{"model": metrics[, "base": metrics]}; prints a table on rank 0."""
    from transformers.utils import logging as hf_logging

    from shardtune.distributed.process_group import init_distributed

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    data_cfg = load_model(args.model, weights=False)[3]  # --compare BASE is evaluated on the same data
    owns = not tdist.is_initialized()
    dist = init_distributed(args.device)
    try:
        results = {"model": eval_one(args.model, args, dist, data_cfg)}
        if args.compare:
            results["base"] = eval_one(args.compare, args, dist, data_cfg)
    finally:
        if owns:
            tdist.destroy_process_group()
    if dist.is_main:
        print(format_table(results, args), flush=True)
    return results


def format_table(results: dict, args) -> str:
    cols = [("base", args.compare), ("model", args.model)] if "base" in results else [("model", args.model)]
    names = ["base" if k == "base" else ("fine-tuned" if "base" in results else "model") for k, _ in cols]
    rows = [("loss", "eval_loss", "{:.4f}"), ("perplexity", "eval_ppl", "{:.3f}"),
            ("accuracy", "eval_acc", "{:.4f}"), ("sequences", "sequences", "{:d}")]
    lines = [f"{'':12}" + "".join(f"{n:>14}" for n in names)]
    for label, key, fmt in rows:
        lines.append(f"{label:12}" + "".join(f"{fmt.format(results[k][key]):>14}" for k, _ in cols))
    lines += [f"{n}: {spec}" for n, (_, spec) in zip(names, cols)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- generate


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot read --prompts-file {args.prompts_file!r} ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise UserError(f"--prompts-file {args.prompts_file!r} is not UTF-8 text (byte {exc.start}); save it "
                            "as UTF-8, one prompt per line") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError("no prompt given; pass --prompt TEXT or --prompts-file FILE (one prompt per line)")
    return prompts


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.7,
             top_p: float = 0.9, seed: int = 0) -> list[str]:
    """The continuation of each prompt; temperature 0 decodes greedily."""

    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise UserError("need --temperature >= 0, 0 < --top-p <= 1 and --max-new-tokens >= 1")
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    sample = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    encoded = []
    limit = max_positions(model.config)
    for n, prompt in enumerate(prompts, 1):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] == 0:  # an empty prompt starts from the beginning-of-text token
            ids = torch.tensor([[tokenizer.bos_token_id or tokenizer.eos_token_id]])
        if limit is not None and ids.shape[1] + max_new_tokens > limit:
            raise UserError(f"prompt {n} has {ids.shape[1]} tokens; with --max-new-tokens {max_new_tokens} that is "
                            f"beyond the model's {limit} positions; shorten the prompt or lower --max-new-tokens")
        encoded.append(ids)
    outputs = []
    for ids in encoded:
        ids = ids.to(device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sample)
        outputs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return outputs


def run_generate(args) -> list[str]:
    from transformers.utils import logging as hf_logging

    from shardtune.distributed.process_group import resolve_device

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    prompts = read_prompts(args)
    model, tokenizer, _, _ = load_model(args.model, str(resolve_device(args.device)))
    texts = generate(model, tokenizer, prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(prompts) > 1:
            print(f"=== prompt {i + 1} ===")
        print(prompt + text, flush=True)
    return texts
