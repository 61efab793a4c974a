"""`shardtune eval` and `shardtune generate`: a trained model, from an HF folder (or hub id),
a run folder, or a sharded checkpoint.

eval shards the model with FSDP like training does (rank 0 holds the one full copy while it is
handed out), so it runs on 1 or N ranks and gives the same numbers: token-weighted loss,
perplexity and next-token accuracy. generate runs in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as tdist

from shardtune.checkpoint.loading import Reading, adapter_structure, load_model, pinned
from shardtune.errors import UserError
from shardtune.evaluation.prompts import check_chat, layout
from shardtune.model.hf import max_positions
from shardtune.model.prompt_learning import output_offset, virtual_tokens

# ----------------------------------------------------------------------------- eval


@dataclass
class EvalRequest:
    """What `shardtune eval` evaluates, and on which data (cli/eval.py builds it from the flags)."""
    model: str  # HF folder or hub id, run folder, or checkpoint folder
    data: str | None = None  # dataset; None: the checkpoint's validation split
    data_name: str | None = None
    split: str | None = None
    text_field: str = "text"
    format: str | None = None  # text, instruct or chat; None: the run's data.format, else text
    seq_len: int | None = None
    micro_batch_size: int = 8
    max_batches: int = 0  # 0: all
    compare: str | None = None  # a base model evaluated on the same data
    device: str = "auto"


def eval_config(req: EvalRequest, run_cfg):
    """The evaluated run's config as eval reads its data: --seq-len in place of the run's block
    length and example cutoff (a copy)."""
    if run_cfg is None or req.seq_len in (None, run_cfg.data.seq_len):
        return run_cfg
    return dataclasses.replace(run_cfg, data=dataclasses.replace(run_cfg.data, seq_len=req.seq_len, cutoff_len=None))


# what picks a run's documents and its validation split, whatever format reads them
RUN_DATA = ("path", "name", "split", "val_split", "val_size", "start_idx", "end_idx", "seq_len", "num_proc")


def data_config(req, run_cfg):
    """The data `req` (an eval or eval --generate request) reads: the run's (its format, fields,
    template), with --data, --data-name, --text-field and --format overriding. A --format other
    than the run's starts from that format's defaults (`prompts.layout`)."""
    if req.data is None and run_cfg is None:
        raise UserError(f"{req.model!r} is not a shardtune checkpoint, so it has no dataset; pass --data PATH")
    cfg = layout(req.format, run_cfg)
    if run_cfg is not None:  # the run's data and its held-out split, in whichever format reads it
        for key in RUN_DATA:
            setattr(cfg, key, getattr(run_cfg.data, key))
    if req.text_field != "text":
        cfg.text_field = req.text_field
    if req.data is not None:
        cfg.path, cfg.name = req.data, req.data_name
    return cfg


def check_eval(req: EvalRequest, run_cfg, hf_config, tokenizer, compare_config=None) -> EvalRequest:
    """`train`'s check of the model's config and tokenizer (`check.run.check_model`) on the run
    config eval uses, before any process group: the same line as train's (an HF folder has none);
    then the block length against every model's positions (`lengths.seq_len`, named --seq-len).
    Returns `req` with its --seq-len."""
    from shardtune.check.run import check_model
    from shardtune.evaluation import lengths

    if req.data is None and run_cfg is None:
        raise UserError(f"{req.model!r} is not a shardtune checkpoint, so it has no dataset; pass --data PATH")
    if run_cfg is not None and req.seq_len is None:
        check_model(run_cfg, hf_config, tokenizer)
    models = [(req.model, hf_config), (req.compare, compare_config)]
    room = lengths.smallest(lengths.room_of(spec, config) for spec, config in models if config is not None)
    req = dataclasses.replace(req, seq_len=lengths.seq_len(req.seq_len, run_cfg.data.seq_len if run_cfg else None,
                                                           room))
    if run_cfg is not None:
        check_model(eval_config(req, run_cfg), hf_config, tokenizer)
    return req


# the data keys a refusal of --data's files names, as the options of eval that set them
DATA_OPTIONS = {"data.text_field": "--text-field", "data.path": "--data", "data.name": "--data-name",
                "data.seq_len": "--seq-len", "data.cutoff_len": "--seq-len", "data.format": "--format"}
# what to do about a column key eval has no option for (data.instruction_field, data.messages_field, ...)
COLUMN_KEYS = r"(?<![\w.])data\.(\w+_field|template)\b"
OTHER_COLUMNS = ("eval reads the columns the run's recipe names (else the defaults): rename the file's columns, "
                 "or choose --format")


def eval_words(text: str) -> str:
    """`text` with the data.* keys eval sets through its options named as those options."""
    for key, option in DATA_OPTIONS.items():
        text = re.sub(rf"(?<![\w.]){re.escape(key)}(?![\w])", option, text)
    return f"{text} ({OTHER_COLUMNS})" if re.search(COLUMN_KEYS, text) else text


@contextlib.contextmanager
def options_named(applies: bool = True):
    """A refusal or warning inside names eval's options, not the config keys they set (eval has no
    data.*); not where eval reads the run's own data as it trained (`applies` false)."""
    from shardtune.data.pipeline import warnings_retold

    if not applies:
        yield
        return
    try:
        with warnings_retold(eval_words):
            yield
    except UserError as exc:
        raise UserError(eval_words(str(exc))) from None


def eval_blocks(req: EvalRequest, run_cfg, tokenizer):
    """Rows to evaluate on, tokenized with `tokenizer` in the format `data_config` gives (the
    run's, unless --format): --data's split, else the validation split the run of `run_cfg` (the
    evaluated checkpoint's) held out. Instruct and chat rows are scored on their responses only,
    as training scored them."""
    from shardtune.data import pipeline as data_lib

    own = eval_config(req, run_cfg)  # check_eval set --seq-len
    cfg = data_config(req, own)
    cfg.seq_len = req.seq_len or cfg.seq_len
    check_chat(cfg, tokenizer)
    # --data, --format or a --seq-len other than the run's: a refusal is about eval's options
    with options_named(req.data is not None or req.format is not None or own is not run_cfg):
        if req.data is None and req.split is None:
            _, val = data_lib.prepare(cfg, tokenizer)
            if val is None:
                raise UserError("the run had no validation split; pass --data PATH [--split NAME]")
            return val
        splits = data_lib.load_documents(cfg)
        split = req.split or next((s for s in ("validation", "test") if s in splits), "train")
        if split not in splits:
            raise UserError(f"dataset {cfg.path!r} has no split {split!r}; choose --split from {', '.join(splits)}")
        blocks = data_lib.tokenize_split(splits[split], cfg, tokenizer, f"split {split!r} of {cfg.path!r}",
                                         required=True)
    if len(blocks) == 0:
        raise UserError(f"split {split!r} of {cfg.path!r} has fewer tokens than one block of {cfg.seq_len}; "
                        "lower --seq-len")
    return blocks.with_format("torch")


def eval_one(spec: str, req: EvalRequest, dist, data_cfg) -> dict:
    """Metrics of one model over all ranks (collective), on the data that `data_cfg` (the run
    config of the evaluated checkpoint, or None) and `req` select."""
    from shardtune.data.batches import eval_batches
    from shardtune.data.pipeline import same_on_every_rank
    from shardtune.distributed.collectives import rank0_first
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.model.hf import check_seq_len
    from shardtune.train.step import evaluate

    # Rank 0 alone reads the full weights; the other ranks only the config and tokenizer.
    source, tokenizer, hf_config, run_cfg = rank0_first(dist, lambda: load_model(spec, weights=dist.is_main))
    ds = rank0_first(dist, lambda: eval_blocks(req, data_cfg, tokenizer))
    same_on_every_rank(dist, {"evaluation": ds})
    # fp32, full_shard: evaluation needs none of the run's training settings, only its adapter
    layout = ModelSpec(hf_config, loss_chunk_tokens=run_cfg.loss_chunk_tokens if run_cfg else None,
                       peft=adapter_structure(spec),  # an adapter that does not fold into the base
                       trust_remote_code=bool(run_cfg and run_cfg.model.trust_remote_code))
    check_seq_len(hf_config, len(ds[0]["input_ids"]), layout.peft.virtual_tokens)
    held = [source]  # popped by build_model: rank 0's full copy is freed once it is handed out
    del source
    model = build_model(layout, build_mesh(layout.fsdp, dist), dist.device, source=held.pop).model
    batches = eval_batches(len(ds), req.micro_batch_size, dist.world_size, dist.rank, req.max_batches)
    metrics = evaluate(model, ds, batches, dist.device)
    metrics["sequences"] = sum(1 for b in batches for i in b if i >= 0)
    if dist.world_size > 1:
        from shardtune.distributed.collectives import all_sum

        (metrics["sequences"],) = all_sum(metrics["sequences"], device=dist.device)
    metrics["sequences"] = int(metrics["sequences"])
    return metrics


def run_eval(req: EvalRequest) -> dict:
    """{"model": metrics[, "base": metrics]}; prints a table on rank 0."""
    from transformers.utils import logging as hf_logging

    from shardtune.distributed.process_group import init_distributed
    from shardtune.rank.lifecycle import mark_completed

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    said = Reading()
    req = dataclasses.replace(req, model=pinned(req.model, said), compare=pinned(req.compare, said))
    _, tokenizer, hf_config, data_cfg = load_model(req.model, weights=False)  # --compare BASE: the same data
    compare_config = load_model(req.compare, weights=False)[2] if req.compare else None
    req = check_eval(req, data_cfg, hf_config, tokenizer, compare_config)
    said.say()
    owns = not tdist.is_initialized()
    dist = init_distributed(req.device)
    try:
        results = {"model": eval_one(req.model, req, dist, data_cfg)}
        if req.compare:
            results["base"] = eval_one(req.compare, req, dist, data_cfg)
        if dist.is_main:
            print(format_table(results, req), flush=True)
        tdist.barrier()  # the end in a fixed order, as a training run's (Trainer.close)
        mark_completed(0)
    finally:
        if owns:
            tdist.destroy_process_group()
    return results


def format_table(results: dict, req: EvalRequest) -> str:
    cols = [("base", req.compare), ("model", req.model)] if "base" in results else [("model", req.model)]
    names = ["base" if k == "base" else ("fine-tuned" if "base" in results else "model") for k, _ in cols]
    rows = [("loss", "eval_loss", "{:.4f}"), ("perplexity", "eval_ppl", "{:.3f}"),
            ("accuracy", "eval_acc", "{:.4f}"), ("sequences", "sequences", "{:d}")]
    lines = [f"{'':12}" + "".join(f"{n:>14}" for n in names)]
    for label, key, fmt in rows:
        lines.append(f"{label:12}" + "".join(f"{fmt.format(results[k][key]):>14}" for k, _ in cols))
    lines += [f"{n}: {spec}" for n, (_, spec) in zip(names, cols)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- generate


@dataclass
class GenerateRequest:
    """What `shardtune generate` runs (cli/generate.py builds it from the flags)."""
    model: str  # HF folder or hub id, run folder, or checkpoint folder
    prompts: list[str] = field(default_factory=list)
    prompts_file: str | None = None  # one prompt per line, after `prompts`
    max_new_tokens: int | None = None  # None: 64, fewer where the model's positions hold less (evaluation.lengths)
    temperature: float = 0.7  # 0: greedy
    top_p: float = 0.9
    seed: int = 0
    batch_size: int = 8  # prompts per generate call, left-padded
    format: str | None = None  # how prompts are laid out (evaluation.prompts); None: the run's data.format, else text
    device: str = "auto"


def read_prompts(req: GenerateRequest) -> list[str]:
    prompts = list(req.prompts)
    if req.prompts_file:
        try:
            text = Path(req.prompts_file).read_text(encoding="utf-8-sig")  # a BOM is no part of a prompt
        except OSError as exc:
            raise UserError(f"cannot read --prompts-file {req.prompts_file!r} ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise UserError(f"--prompts-file {req.prompts_file!r} is not UTF-8 text (byte {exc.start}); save it "
                            "as UTF-8, one prompt per line") from None
        # lines end at \n alone (read_text made \r\n and \r one): splitlines() also cut a prompt at a form feed,
        # U+2028, U+0085 or \x1c-\x1e inside it, giving two prompts for one line
        prompts += [line for line in text.split("\n") if line.strip()]
    if not prompts:
        raise UserError("no prompt given; pass --prompt TEXT or --prompts-file FILE (one prompt per line)")
    return prompts


# A temperature below this decodes greedily: sampling at it picks the likeliest token anyway, and
# the logits divided by it can overflow float32 to inf (1e-300 does), which sampling cannot take.
GREEDY_BELOW = 1e-5
# Only the options choose the next token: transformers fills what generate is not given from the
# model's generation_config.json (beams, penalties, suppressed tokens, stop strings, DoLa: other texts or
# tracebacks), so the model decodes with a blank one (`plain_decoding`); sampling drops transformers' top-k of 50.


def generate(model, tokenizer, prompts: list, max_new_tokens: int = 64, temperature: float = 0.7,
             top_p: float = 0.9, seed: int = 0, batch_size: int = 8, stop: list[int | str] = ()) -> list[str]:
    """The continuation of each prompt (a string, or token ids), `batch_size` prompts per `model.generate` call,
    left-padded so every row's new tokens start in the same column, up to the first end-of-sequence token of the
    model's generation config or of `stop` (data.chat.trained_ends: token ids, and texts of several tokens);
    temperature 0 (or below GREEDY_BELOW) decodes greedily. Seeded once: the same call gives the same texts. A
    prompt longer than the model's positions leave room for is cut from the left, after the BOS training put first."""
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise UserError("need --temperature >= 0, 0 < --top-p <= 1 and --max-new-tokens >= 1")
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    sample = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) \
        if temperature >= GREEDY_BELOW else dict(do_sample=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    rows = [list(p) if not isinstance(p, str) else tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    rows = [r or [start] for r in rows]  # an empty prompt starts from the beginning-of-text token
    limit = max_positions(model.config)
    if limit is not None:  # a prompt too long for the model keeps its end, where the answer starts
        from shardtune.data import formats

        limit -= virtual_tokens(model)  # prefix/prompt tuning's, before the prompt
        if max_new_tokens >= limit:
            raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's {limit} "
                            f"positions; set --max-new-tokens {limit - 1} or less")
        keep, bos = limit - max_new_tokens, formats.leading_bos(tokenizer)  # and the BOS it starts with, if any
        rows = [r if len(r) <= keep else r[:1] + r[len(r) - keep + 1:] if bos and r[:1] == bos and keep > 1
                else r[len(r) - keep:] for r in rows]
    if output_offset(model):  # peft drops prompt tuning's position ids: left padding would shift the positions
        batch_size = 1
    # a mixture of experts trained with its router loss (output_router_logits) computes that loss in every
    # decoding step too, over the whole attention mask and one new token's router logits: a crash once padded
    router = dict(output_router_logits=False) if getattr(model.config, "output_router_logits", False) else {}
    ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = list(dict.fromkeys([*(ends if isinstance(ends, list) else [] if ends is None else [ends]),
                               *(s for s in stop if isinstance(s, int))]))
    texts = [s for s in stop if isinstance(s, str)]
    at_texts = dict(stop_strings=texts, tokenizer=tokenizer) if texts else {}
    outputs = []
    for i in range(0, len(rows), max(batch_size, 1)):
        batch = rows[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=device)
        with torch.no_grad(), plain_decoding(model):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 eos_token_id=ends or None, **at_texts, **sample, **router)
        outputs += [before(continuation(tokenizer, r, until(new, ends)), texts)
                    for r, new in zip(batch, out[:, width:].tolist(), strict=True)]
    return outputs


@contextlib.contextmanager
def plain_decoding(model):
    """`model` (and a peft wrapper's inner one: each that holds one) with a blank generation config, its own after."""
    from transformers import GenerationConfig

    held = [(m, c) for m in model.modules() if isinstance(c := vars(m).get("generation_config"), GenerationConfig)]
    for m, _ in held:
        m.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for m, config in held:
            m.generation_config = config


def until(new_ids: list[int], ends: list[int]) -> list[int]:
    """The new tokens before the first end: an end that is no special token (a template's added
    end of turn) would read as text, and what follows it in a batch is padding."""
    cut = next((i for i, t in enumerate(new_ids) if t in ends), len(new_ids))
    return new_ids[:cut]


def before(text: str, ends: list[str]) -> str:
    """`text` up to the first of `ends` in it."""
    return text[:min((text.find(e) for e in ends if e in text), default=len(text))]


def continuation(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text `new_ids` add after `prompt_ids`. Decoded alone, new tokens lose what a decoder
    gives only after an earlier token (a SentencePiece word's leading space: Llama-2, Mistral, whose
    `The capital is` + `Paris` read `The capital isParis`), and a character whose bytes the prompt
    began (byte-level BPE) is U+FFFD twice; decoded after the prompt they read as the model wrote them."""
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode(list(prompt_ids) + list(new_ids), skip_special_tokens=True)
    for stem in (head, head.rstrip("\ufffd")):  # a character cut at the prompt's end is whole with the new bytes
        if whole.startswith(stem):
            return whole[len(stem):]
    return tokenizer.decode(new_ids, skip_special_tokens=True)  # a decoder that rewrites the prompt's text


def run_generate(req: GenerateRequest) -> list[str]:
    from transformers.utils import logging as hf_logging

    from shardtune.data import chat
    from shardtune.distributed.process_group import resolve_device

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from shardtune.evaluation import lengths
    from shardtune.evaluation import prompts as layouts

    said = Reading(sys.stderr)  # stdout holds the texts alone
    req = dataclasses.replace(req, model=pinned(req.model, said))
    _, tokenizer, hf_config, run_cfg = load_model(req.model, weights=False)  # checked before the weights load
    cfg = layouts.layout(req.format, run_cfg)
    prompts, ids = zip(*layouts.rendered(read_prompts(req), cfg, tokenizer))
    said.say()
    notes: list[str] = []  # said after the texts: the output is the texts, stderr is for errors
    if cfg.format != "text" and req.format is None:
        notes.append(f"the prompts are laid out as the run's {cfg.format} data; --format text sends them as given")
    new_tokens = lengths.new_tokens(req.max_new_tokens, lengths.smallest([lengths.room_of(req.model, hf_config)]),
                                    max(map(len, ids)), notes.append)
    model, tokenizer, _, _ = load_model(req.model, str(resolve_device(req.device)))
    texts = generate(model, tokenizer, list(ids), new_tokens, req.temperature, req.top_p, req.seed, req.batch_size,
                     chat.trained_ends(cfg, tokenizer))
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(prompts) > 1:
            print(f"=== prompt {i + 1} ===")
        print(prompt + text, flush=True)
    for line in notes:
        print(f"note: {line}", file=sys.stderr, flush=True)
    return texts
