"""`shardtune eval MODEL --generate N`: what the model generates for N prompts of a dataset split,
scored against the references (ROUGE, BLEU, chrF; MAUVE as an extra) and on its own (diversity,
degeneration); with --compare BASE the base model on the same prompts, side by side. The prompts
are the prompt part of instruct/chat examples (rendered as training renders them) or the first K
tokens of text documents, whose next tokens are the reference. Numbers and every generation go to
a JSON file that `shardtune report` draws."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from shardtune.checkpoint.loading import Reading, load_model, model_step, pinned, run_folder
from shardtune.checkpoint.rundir import refuse_run_file
from shardtune.errors import UserError
from shardtune.evaluation import lengths, textscores
from shardtune.evaluation.evaluate import before, continuation, data_config, generate, options_named, until
from shardtune.evaluation.prompts import check_chat
from shardtune.fsio import make_dir, refuse_foreign_file, write_text_atomic

SHOWN_EXAMPLES = 3  # example generations in the printed table (the JSON has all)
OUT_MARK = "\"generate_s\":"  # in every JSON `eval --generate` writes (each model's time): only those are replaced


@dataclasses.dataclass
class QualityRequest:
    """What `shardtune eval --generate` runs (cli/eval.py builds it from the flags)."""
    model: str  # HF folder or hub id, run folder, or checkpoint folder
    generate: int  # prompts to generate for
    data: str | None = None  # dataset; None: the run's validation documents
    data_name: str | None = None
    split: str | None = None
    text_field: str = "text"
    format: str | None = None  # text, instruct or chat; None: the run's data.format, else text
    prompt_tokens: int | None = None  # text documents: the prompt's length in tokens (None: 32, or what fits)
    max_new_tokens: int | None = None  # None: 64, or what fits beside the prompt (evaluation.lengths)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 0.9
    seed: int = 0
    micro_batch_size: int = 8  # prompts per generate call
    metrics: str = ",".join(textscores.DEFAULT_METRICS)
    mauve_featurizer: str | None = None
    compare: str | None = None  # a base model on the same prompts
    out: str | None = None  # the JSON file; None: RUN/generation.json, else ./generation.json
    overwrite: bool = False  # replace `out` even if this command did not write it
    device: str = "auto"


@dataclasses.dataclass
class Example:
    prompt: str
    reference: str
    prompt_ids: list[int]  # in the tokenizer of the evaluated model


def check_request(req: QualityRequest) -> list[str]:
    """Everything about the options that can be refused before a model is loaded; the metrics."""
    if req.generate < 1:
        raise UserError(f"--generate must be at least 1 prompt, got {req.generate}")
    if req.prompt_tokens is not None and req.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be at least 1, got {req.prompt_tokens}")
    if req.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size must be at least 1, got {req.micro_batch_size}")
    if req.temperature < 0 or not 0 < req.top_p <= 1 or (req.max_new_tokens is not None and req.max_new_tokens < 1):
        raise UserError("need --temperature >= 0, 0 < --top-p <= 1 and --max-new-tokens >= 1")
    metrics = textscores.parse_metrics(req.metrics)
    if "mauve" in metrics and not req.mauve_featurizer:
        raise UserError("--metrics mauve needs --mauve-featurizer MODEL (a local folder or a downloaded hub id, "
                        "e.g. gpt2)")
    return metrics


def documents(req: QualityRequest, cfg, run_cfg):
    """The split to prompt from: --split, else the run's own validation documents (the same
    seeded hold-out as training), else validation/test/train of --data."""
    from shardtune.data import pipeline as data_lib

    splits = data_lib.load_documents(cfg)
    if req.split is None and req.data is None:
        return data_lib.split_documents(cfg, splits)[1]
    split = req.split or next((s for s in ("validation", "test") if s in splits), "train")
    if split not in splits:
        raise UserError(f"dataset {cfg.path!r} has no split {split!r}; choose --split from {', '.join(splits)}")
    return splits[split]


def examples(req: QualityRequest, cfg, docs, tokenizer) -> list[Example]:
    """The first N usable rows of `docs` as prompts and references, in the split's order."""
    from shardtune.data import chat, formats

    what = f"dataset {cfg.path!r}"
    notes: list[str] = []
    formats.check_cells(docs, cfg, what, notes.append)  # training's check of the columns read: no prompt of `5`
    out: list[Example] = []
    if cfg.format == "text":
        docs, field = formats.render_text(docs, cfg, what)
        bos, cut = formats.leading_bos(tokenizer), req.prompt_tokens  # the BOS is one of the prompt's tokens
        for text in docs[field]:
            ids = formats.text_ids(tokenizer, text, bos)  # as trained
            if len(ids) > cut:  # a document with a continuation to compare with
                prompt, after = ids[:cut], ids[cut:cut + req.max_new_tokens]
                reference = continuation(tokenizer, prompt, after)  # as the generations are decoded
                out.append(Example(tokenizer.decode(prompt, skip_special_tokens=True), reference, prompt))
            if len(out) == req.generate:
                break
    elif cfg.format == "instruct":
        formats.instruct_fn(cfg, tokenizer, docs.column_names, what)  # checks the columns
        for row in docs:
            ids = formats.instruct_prompt_ids(cfg, tokenizer, row)
            out.append(Example(formats.instruct_prompt(cfg, row), formats.instruct_response(cfg, row), ids))
            if len(out) == req.generate:
                break
    else:
        chat.chat_fn(cfg, tokenizer, docs.column_names, what)  # checks the column and the template
        ends = chat.trained_ends(cfg, tokenizer)
        for index, value in enumerate(docs[cfg.messages_field]):
            pair = chat.chat_prompt_and_reply(tokenizer, value, index, cfg.messages_field)
            if pair is not None:
                ids, reply = chat.reply_ids(tokenizer, *pair)
                out.append(Example(pair[0], as_generated(tokenizer, ids, reply, ends), ids))
            if len(out) == req.generate:
                break
    if not out:
        why = f" longer than --prompt-tokens {req.prompt_tokens}" if cfg.format == "text" else ""
        raise UserError(f"{what} has no {cfg.format} example{why} to prompt with; check --data/--split"
                        + (" or lower --prompt-tokens" if why else ""))
    for line in notes:  # only once there are prompts: a refusal stays one line
        print(line, file=sys.stderr, flush=True)
    if len(out) < req.generate:
        print(f"note: {what} has only {len(out)} usable example(s); scoring those", flush=True)
    return out


def as_generated(tokenizer, prompt_ids: list[int], reply_ids: list[int], ends: list[int | str]) -> str:
    """A chat reply's tokens as training labels them (its end included) as `generate` returns a
    model's writing of them: cut at the first end, decoded after the prompt. Its content alone was the
    reference, so the reply a model learned (a Qwen3 template's empty <think></think>, then the
    content) scored ROUGE-1 0.5 against a one-word answer it wrote exactly."""
    return before(continuation(tokenizer, prompt_ids, until(reply_ids, [e for e in ends if isinstance(e, int)])),
                  [e for e in ends if isinstance(e, str)])


def generate_for(spec: str, req: QualityRequest, device: str, prompts: list[Example],
                 ref_tokenizer, cfg) -> tuple[list[str], float]:
    """(one generation per prompt, seconds) of the model `spec`; a model with another tokenizer
    than the evaluated one gets the prompt text in its own tokens, after its own BOS (a Llama-style
    base read every text of its training after <s>: without it, it generated other text)."""
    from shardtune.data import chat, formats

    model, tokenizer, _, _ = load_model(spec, device)
    same = tokenizer.get_vocab() == ref_tokenizer.get_vocab()
    inputs = [e.prompt_ids if same else formats.text_ids(tokenizer, e.prompt) for e in prompts]
    start = time.perf_counter()
    texts = generate(model, tokenizer, inputs, req.max_new_tokens, req.temperature, req.top_p, req.seed,
                     req.micro_batch_size, chat.trained_ends(cfg, tokenizer))
    return texts, time.perf_counter() - start


def fit_lengths(req: QualityRequest, cfg, hf_config):
    """(req with the lengths known before the prompts are read, the models' Room): text documents
    their --prompt-tokens and --max-new-tokens together; other formats a given --max-new-tokens."""
    rooms = [lengths.room_of(req.model, hf_config)]
    if req.compare:
        rooms.append(lengths.room_of(req.compare, load_model(req.compare, weights=False)[2]))
    room = lengths.smallest(rooms)
    if cfg.format != "text" and req.prompt_tokens is not None:  # was ignored: its row's prompt part is the prompt
        raise UserError(f"--prompt-tokens applies only to text documents; a {cfg.format} row's prompt is its prompt "
                        "part as training renders it; drop --prompt-tokens (or choose --format text)")
    if cfg.format == "text":
        prompt, new = lengths.prompt_and_new_tokens(req.prompt_tokens, req.max_new_tokens, room)
        return dataclasses.replace(req, prompt_tokens=prompt, max_new_tokens=new), room
    if req.max_new_tokens is not None:
        lengths.new_tokens(req.max_new_tokens, room, 0)
    return req, room


def default_out(spec: str) -> Path:
    """generation.json in the run folder (where `shardtune report RUN` finds it), else in the
    working folder."""
    run = run_folder(spec)
    return run / "generation.json" if run else Path("generation.json")


def run_quality(req: QualityRequest) -> dict:
    """Generate and score; print the table; write the JSON. Returns what it wrote."""
    from transformers.utils import logging as hf_logging

    from shardtune.distributed.process_group import resolve_device

    metrics = check_request(req)
    said = Reading()
    req = dataclasses.replace(req, model=pinned(req.model, said), compare=pinned(req.compare, said))
    out = Path(req.out) if req.out else default_out(req.model)
    refuse_run_file(out, "--out")  # before any work
    refuse_foreign_file(out, "--out", "an output of `eval --generate`", OUT_MARK, req.overwrite)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if "mauve" in metrics:
        os.environ.setdefault("DISABLE_TQDM", "1")  # mauve-text's featurizing bar
    featurizer = textscores.load_featurizer(req.mauve_featurizer) if "mauve" in metrics else None
    _, tokenizer, hf_config, run_cfg = load_model(req.model, weights=False)
    cfg = data_config(req, run_cfg)
    check_chat(cfg, tokenizer)
    req, room = fit_lengths(req, cfg, hf_config)
    said.say()
    with options_named(req.data is not None or req.format is not None):
        prompts = examples(req, cfg, documents(req, cfg, run_cfg), tokenizer)
    if req.max_new_tokens is None:  # instruct/chat prompts: the longest leaves the room for new tokens
        req = dataclasses.replace(req, max_new_tokens=lengths.new_tokens(None, room, max(
            len(e.prompt_ids) for e in prompts)))
    device = str(resolve_device(req.device))
    references = [e.reference for e in prompts]
    settings = {k: getattr(req, k) for k in ("generate", "prompt_tokens", "max_new_tokens", "temperature", "top_p",
                                              "seed", "micro_batch_size", "split")}
    result = {"settings": {**settings, "data": cfg.path, "format": cfg.format, "metrics": metrics,
                           "prompts": len(prompts)}, "models": {}}
    generations = {}
    for role, spec in [("model", req.model)] + ([("base", req.compare)] if req.compare else []):
        texts, seconds = generate_for(spec, req, device, prompts, tokenizer, cfg)
        generations[role] = texts
        scores = textscores.score(texts, references, metrics, req.seed, featurizer)
        # the step tells `report` whether these are still the scores of the run's model (generation_report)
        result["models"][role] = {"spec": spec, "step": model_step(spec), "scores": scores, "generate_s": seconds}
    result["examples"] = [{"prompt": e.prompt, "reference": e.reference, **{r: g[i] for r, g in generations.items()}}
                          for i, e in enumerate(prompts)]
    make_dir(out.parent)
    write_text_atomic(out, json.dumps(result, indent=1))
    print(format_scores(result), flush=True)
    print(f"generations and scores written to {out}", flush=True)
    return result


def clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def format_scores(result: dict) -> str:
    """Scores side by side (base first), then a few example generations."""
    models = result["models"]
    roles = [r for r in ("base", "model") if r in models]
    names = {"base": "base", "model": "fine-tuned" if "base" in models else "model"}
    keys = list(models["model"]["scores"])
    lines = [f"{'':14}" + "".join(f"{names[r]:>14}" for r in roles)]
    lines += [f"{k:14}" + "".join(f"{models[r]['scores'][k]:>14.4f}" for r in roles) for k in keys]
    lines.append(f"{'generate_s':14}" + "".join(f"{models[r]['generate_s']:>14.2f}" for r in roles))
    lines += [f"{names[r]}: {models[r]['spec']}" + ("" if models[r].get("step") is None else
                                                   f" (step {models[r]['step']})") for r in roles]
    for i, ex in enumerate(result["examples"][:SHOWN_EXAMPLES]):
        lines += ["", f"--- example {i + 1}", f"prompt     ...{clip(ex['prompt'][-200:], 77)}",
                  f"reference  {clip(ex['reference'], 80)}"]
        lines += [f"{names[r]:<11}{clip(ex[r], 80)}" for r in roles]
    return "\n".join(lines)
