"""Checks of a run config that need no model, data or process group: they run when the
config is loaded, before any work, so a bad value costs well under a second, not a tokenized
dataset. Checks that need the model or the data stay where those are."""

from __future__ import annotations

import dataclasses
import math
import re
import string

from shardtune.errors import UserError
from shardtune.hardware import LIGER_NEEDS_CUDA, float8_needs

MAX_TEMPLATE_WIDTH = 10_000  # characters a template may pad one column to


def template_columns(template: str, key: str = "data.template") -> list[str]:
    """Column names a `str.format` template refers to ({a}, {a[0]}, {a.b} all name column a)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise UserError(f"{key}={template!r} is not a valid template ({exc}); name columns in braces "
                        "like {quote} and write literal braces as {{ }}") from None
    names = []
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            raise UserError(f"{key}={template!r} has the conversion !{conversion}; use !r, !s or !a, or none")
        if "{" in (spec or ""):  # a width read from a cell escapes the cap below (and names no checked column)
            raise UserError(f"{key}={template!r} takes the format spec of {{{field}}} from a field ({spec}); write "
                            "the spec out, e.g. {quote:>40}")
        # a width or precision like {x:10000000000} would render gigabytes per row
        if any(int(n) > MAX_TEMPLATE_WIDTH for n in re.findall(r"\d+", spec or "")):
            raise UserError(f"{key}={template!r} asks for a width above {MAX_TEMPLATE_WIDTH} characters in "
                            f"{{{field}:{spec}}}; use a smaller width")
        # {x.__class__}, {x.__init__.__globals__}: Python's internals, not data (a record's fields are {x[field]})
        if any(a.startswith("_") for a in re.findall(r"\.([^.\[]*)", re.sub(r"\[[^\]]*\]", "", field))):
            raise UserError(f"{key}={template!r} reads a Python attribute in {{{field}}}, not data; name a column, "
                            "or a field of a record column as {column[field]}")
        name = re.match(r"[^.\[]*", field).group(0)
        if not name or name.isdigit():
            raise UserError(f"{key}={template!r} has a positional field {{{field}}}; name a column "
                            "instead, e.g. {text}")
        if name not in names:
            names.append(name)
    return names


INT_LIMIT = 2 ** 63 - 1  # the largest count or seed torch and numpy take (seed + step + rank must fit too)


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values of a numeric config key; `above`/`below` are exclusive bounds."""
    least: float | None = 0
    most: float | None = None
    above: float | None = None
    below: float | None = None

    def refuse(self, value) -> str | None:
        """Why `value` is out of range, or None."""
        for bound, ok, word in ((self.least, value >= (self.least or 0), "at least"),
                                (self.most, value <= (self.most or 0), "at most"),
                                (self.above, value > (self.above or 0), "above"),
                                (self.below, value < (self.below or 0), "below")):
            if bound is not None and not ok:
                return f"must be {word} {bound}"
        return None


# Every number of the config is finite, 0 or more and (ints) at most INT_LIMIT unless this table
# says otherwise; a new key gets those bounds by itself and an entry here only when they differ.
BOUNDS = {
    # a global batch of 2**40 sequences is far beyond any run (and micro_batch_size=auto's divisors stay quick)
    "train.micro_batch_size": Range(1), "train.global_batch_size": Range(1, 2 ** 40), "train.lr": Range(None, above=0),
    "train.min_lr_ratio": Range(0, 1), "train.betas": Range(0, below=1),
    # a block of one token has nothing to predict: loss 0, perplexity 1, a wrong answer
    "data.seq_len": Range(2), "data.cutoff_len": Range(2), "data.num_proc": Range(1, 1024),
    "activation_checkpointing_every": Range(1),
    "log.every_steps": Range(1), "log.peak_tflops": Range(None, above=0), "log.profile_steps": Range(1),
    "fsdp.min_num_params": Range(1), "fsdp.shard_size": Range(1), "fsdp.replicate_size": Range(1),
    "log.watch_every": Range(1), "publish.retries": Range(1),
    "eval.micro_batch_size": Range(1), "peft.r": Range(1), "peft.alpha": Range(1), "peft.dropout": Range(0, below=1),
    "peft.num_virtual_tokens": Range(1), "peft.adapter_len": Range(1), "peft.adapter_layers": Range(1),
}
MAY_BE_EMPTY = {"data.list_sep"}  # text keys where "" means something (join list cells with nothing)


def _leaves(node, prefix: str = ""):
    """(key, value, field) of every config value that is not a section, lists and mappings whole."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, key + ".")
        else:
            yield key, value, f


def check_values(cfg) -> None:
    """Range, finiteness and emptiness of every value, by type: one line naming the first bad one."""
    for key, value, f in _leaves(cfg):
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not value and f.default is None:
            raise UserError(f"{key}=[] is empty; leave {key} unset for the default, or list what you mean")
        _refuse_repeated_names(key, value)
        for item in items:
            _check_value(key, item)


def _refuse_repeated_names(key: str, value) -> None:
    """A list of names (trackers, modules) names each thing once: a second tracker of one kind
    logged every point twice, or failed to start beside the first (MLflow's one active run)."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return
    twice = next((item for i, item in enumerate(value) if item in value[:i]), None)
    if twice is not None:
        once = ",".join(dict.fromkeys(value))
        raise UserError(f"{key} lists {twice} twice; name each once, e.g. {key}=[{once}]")


JSON_LEAVES = (str, int, float, bool, type(None))  # what a model's config.json (and meta.json) holds


def _check_value(key: str, value) -> None:
    if isinstance(value, dict):  # model.config: passed to transformers, which checks little
        for name, inner in value.items():
            if not isinstance(name, JSON_LEAVES):  # a date as a key (`2024-01-01:`): JSON cannot write it
                raise UserError(f"{key} has the key {name!r}, which a config.json cannot hold; quote it, e.g. "
                                f"'{name}'")
            _check_inner(f"{key}.{name}", inner, f"{key}.{name}={inner} is not a finite number; give a real value")
    elif isinstance(value, list):
        for inner in value:
            _check_inner(key, inner, f"{key} holds {inner}, not a finite number; give real values")
    elif isinstance(value, str):
        if key not in MAY_BE_EMPTY and not value.strip():
            raise UserError(f"{key} is empty; give a value, or leave it out for the default")
        if "\x00" in value:
            raise UserError(f"{key} contains a NUL character; give plain text")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison: refuse it first
            raise UserError(f"{key}={value} is not a finite number; give a real value")
        rng = BOUNDS.get(key, Range())
        why = rng.refuse(value) or ("must be at most 2**63-1" if isinstance(value, int) and value > INT_LIMIT
                                    else None)
        if why:
            shown = value if abs(value) < 10 ** 30 else f"a number of about {int(math.log10(abs(value)))} digits"
            raise UserError(f"{key}={shown} {why}; give a value in range")


def _check_inner(key: str, value, not_finite: str) -> None:
    """A value inside model.config (or a list): finite (`not_finite` says it), one JSON can write
    (`!!binary`, `!!set`: the run's config.json and checkpoints could not be saved, a crash
    mid-build), and its own insides the same."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(not_finite)
    if not isinstance(value, (*JSON_LEAVES, dict, list)):
        raise UserError(f"{key} holds a {type(value).__name__} value, which a config.json cannot hold; give text, "
                        "a number, true/false, null, a list or a mapping")
    if isinstance(value, (dict, list)):
        _check_value(key, value)


def validate(cfg) -> None:
    """Every check of a RunConfig that needs only the config."""
    t, d = cfg.train, cfg.data
    if cfg.model.name_or_path is None and not cfg.model.config:
        raise UserError("no model given; set model.name_or_path=<hub id or folder> "
                        "(or model.config={model_type: gpt2, ...} for a random-init model)")
    if d.path is None:
        raise UserError("no dataset given; set data.path=<hub id, file or folder>")
    check_values(cfg)
    auto_batch = t.micro_batch_size == "auto"  # the planner picks it (it checks that one divides the batch)
    if not auto_batch and t.global_batch_size % t.micro_batch_size:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                        f"train.micro_batch_size={t.micro_batch_size}; pick sizes that divide")
    if t.max_steps == 0 and t.epochs == 0:
        raise UserError("set train.max_steps or train.epochs to a positive number")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise UserError(f"train.betas must be two numbers in [0, 1), got {t.betas}; e.g. train.betas=[0.9,0.95]")
    if d.val_size >= 1 and not float(d.val_size).is_integer():  # 1.5 held out one document (1.5 %?)
        raise UserError(f"data.val_size={d.val_size:g} is neither a fraction below 1 nor a whole count of documents; "
                        f"give a count like {int(d.val_size)} or a fraction like {d.val_size / 100:g}")
    if d.start_idx is not None and d.end_idx is not None and d.end_idx <= d.start_idx:
        raise UserError(f"data.end_idx={d.end_idx} must be greater than data.start_idx={d.start_idx}")
    if d.val_split is not None and d.val_split == d.split:  # it validated on the very examples it trained on
        raise UserError(f"data.val_split={d.val_split} is the split it trains on (data.split); name another split, "
                        "or drop data.val_split to carve validation examples out of the training split")
    if cfg.resume == "auto" and not cfg.output_dir:
        raise UserError("resume=auto continues the run in output_dir; set output_dir=<that run's folder>")
    ps = cfg.log.profile_steps
    if ps is not None and (len(ps) != 2 or not 1 <= ps[0] <= ps[1]):
        raise UserError(f"log.profile_steps={ps} must be [first, last] optimizer steps with 1 <= first <= last; "
                        "e.g. log.profile_steps=[3,5] (a few steps: traces grow with every step)")
    _validate_format(d)
    _validate_adapters(cfg)
    _validate_memory_savers(cfg)
    _validate_publish(cfg)
    _validate_checkpoint(cfg)


def _validate_checkpoint(cfg) -> None:
    c = cfg.checkpoint
    if not c.hf_format:
        return
    if cfg.peft.method != "none":
        raise UserError(f"checkpoint.hf_format=true writes a full model, but with peft.method={cfg.peft.method} a "
                        "checkpoint's model is an adapter; drop checkpoint.hf_format (`shardtune export` writes "
                        "the adapter of any checkpoint)")
    if not (c.every_steps or c.at_epoch_end):
        raise UserError("checkpoint.hf_format=true applies to checkpoints, but none are saved; set "
                        "checkpoint.every_steps=N (or drop checkpoint.hf_format)")


def _validate_format(d) -> None:
    if d.format != "text" and not 2 <= d.example_cutoff <= d.seq_len:
        raise UserError(f"data.cutoff_len={d.cutoff_len} must be between 2 and data.seq_len={d.seq_len}; "
                        "lower it, or raise data.seq_len (the model's position limit is checked against seq_len)")
    if d.padding_free and d.format == "text":  # text is always packed into full blocks, whatever data.packing says
        raise UserError("data.padding_free lays unpacked instruct/chat examples end to end, but data.format=text is "
                        "packed into full blocks with no padding to remove; set data.padding_free=false")
    if d.padding_free and d.packing:
        raise UserError("data.padding_free lays unpacked instruct/chat examples end to end, but packed blocks have "
                        "no padding to remove; set data.padding_free=false (or data.packing=false)")
    if d.padding_free and d.document_mask is False:
        raise UserError("data.padding_free=true needs the document mask (examples laid end to end must not see each "
                        "other); drop data.document_mask=false")
    if d.template is not None:
        columns = template_columns(d.template)
        if d.format == "instruct" and d.output_field in columns:  # the prompt would hold the answer it trains on
            raise UserError(f"data.template={d.template!r} is the prompt of data.format=instruct, and it names the "
                            f"response column {{{d.output_field}}} (data.output_field); drop it from the template (the "
                            "response follows the prompt by itself)")


def unread_data_keys(d) -> list[str]:
    """Warning lines for the data keys set away from their defaults that this run does not read
    (data.chat_template with data.format=text, data.instruction_field beside a data.template): a
    warning, not a refusal, so the saved config of a run that set one still resumes."""
    defaults, lines = type(d)(), []
    for f in dataclasses.fields(d):
        key = f.name
        if getattr(d, key) == getattr(defaults, key):
            continue
        formats = d.FORMAT_KEYS.get(key, (d.format,))
        if d.format not in formats:
            why, other = f"is read only with data.format={' or '.join(formats)}", f"set data.format={formats[0]}"
        elif key in ("text_field", "instruction_field", "input_field") and d.template is not None:
            why, other = "is not read beside data.template (the template names the columns)", "drop data.template"
        elif key == "group_by_length" and d.packing:
            why, other = "has no effect on packed blocks (each is data.seq_len tokens)", "set data.packing=false"
        elif key == "document_mask" and d.document_mask and d.format != "text" and not (d.packing or d.padding_free):
            why, other = "has no effect on unpacked examples (a row holds one)", "set data.packing=true"
        elif key == "val_size" and d.val_split is not None:
            why, other = "is not read when data.val_split names the validation split", "drop data.val_split"
        else:
            continue
        lines.append(f"warning: data.{key} {why}, and this run (data.format={d.format}) ignores it; drop it, "
                     f"or {other}")
    return lines


def _validate_adapters(cfg) -> None:
    p, fr, m = cfg.peft, cfg.freeze, cfg.model
    _check_method_keys(p)
    if p.method != "none" and (fr.trainable_blocks is not None or fr.head_only or fr.embeddings):
        raise UserError(f"freeze.* does not combine with peft.method={p.method} (the method already freezes the "
                        "base); drop one of them")
    if fr.head_only and fr.trainable_blocks is not None:
        raise UserError("freeze.head_only and freeze.trainable_blocks exclude each other; set only one")
    if p.virtual_tokens and cfg.data.masks_documents:
        # the learned tokens sit before the first document only; restarting positions hide them from the rest
        raise UserError(f"peft.method={p.method} puts learned tokens before each sequence, which the document mask "
                        "would hide from every document but the first; set data.document_mask=false (and "
                        "data.padding_free=false), or use peft.method=lora")
    if p.method == "prefix_tuning" and cfg.activation_checkpointing not in ("none", "auto"):  # auto: none
        # the prefix is the attention cache, which a recomputed block would extend a second time
        raise UserError(f"peft.method=prefix_tuning does not combine with activation_checkpointing="
                        f"{cfg.activation_checkpointing} (recomputing a block would add to its prefix cache "
                        "again); set activation_checkpointing=none, or use peft.method=prompt_tuning")
    if p.prompt_init_text is not None and not p.prompt_init_text.strip():
        raise UserError("peft.prompt_init_text is empty; give the words the virtual tokens start from, or drop "
                        "it for a random init")
    if 0 < p.lora_plus_ratio < 1:
        raise UserError(f"peft.lora_plus_ratio={p.lora_plus_ratio} would slow the B matrices down; LoRA+ takes a "
                        "ratio of at least 1 (e.g. 16), or 0 for off")
    if p.feedforward_modules is not None and p.target_modules is not None \
            and not set(p.feedforward_modules) <= set(p.target_modules):
        raise UserError(f"peft.feedforward_modules {sorted(set(p.feedforward_modules) - set(p.target_modules))} are "
                        "not in peft.target_modules; IA3 scales only targets: list them there too")
    if p.residual_init and p.quantize != "none":
        raise UserError(f"peft.init={p.init} rewrites the base weights as a residual, which peft.quantize=4bit "
                        "keeps frozen in NF4; use peft.init=default (or gaussian) with QLoRA")
    if p.quantize != "none":
        if cfg.device == "cpu":
            raise UserError("peft.quantize=4bit (QLoRA) needs a CUDA GPU and bitsandbytes; "
                            "on this machine use peft.quantize=none (plain LoRA)")
        if m.name_or_path is None or m.random_init:
            raise UserError("peft.quantize=4bit quantizes pretrained weights; set model.name_or_path and "
                            "model.random_init=false")


def _check_method_keys(p) -> None:
    """A method-specific key set away from its default for a method that does not take it (peft.r
    with ia3, peft.num_virtual_tokens with lora): one line naming the methods that take it."""
    defaults = type(p)()
    for key, methods in p.METHOD_KEYS.items():
        if getattr(p, key) != getattr(defaults, key) and p.method not in methods:
            raise UserError(f"peft.{key} is a setting of peft.method={'/'.join(methods)}, not of "
                            f"peft.method={p.method}; drop peft.{key}, or choose one of those methods")


def _validate_memory_savers(cfg) -> None:
    """Reduction dtype, float8, activation checkpointing kinds and offloading: the combinations that cannot work."""
    if cfg.fsdp.reduce_dtype == "bf16" and cfg.precision != "bf16":
        # fp32 compute exists for exact numbers; bf16 reductions would round every gradient anyway
        raise UserError(f"fsdp.reduce_dtype=bf16 needs precision=bf16 (got precision={cfg.precision}); "
                        "set precision=bf16, or keep fsdp.reduce_dtype=fp32")
    if cfg.float8 != "none":
        if cfg.precision != "bf16":
            raise UserError(f"float8={cfg.float8} runs the matmuls in float8 and the rest in bf16; set precision=bf16 "
                            f"(got precision={cfg.precision}), or float8=none")
        if cfg.peft.adapter:
            raise UserError(f"float8={cfg.float8} trains full linear layers, which peft.method={cfg.peft.method} "
                            "keeps frozen; set float8=none (precision=bf16) for adapters")
        if cfg.device == "cpu":
            raise UserError(f"{float8_needs(cfg.float8)}; with device=cpu set float8=none")
    if cfg.kernels == "liger":
        if cfg.device == "cpu":
            raise UserError(LIGER_NEEDS_CUDA)
        if cfg.loss_chunk_tokens is not None:  # one head-loss path per job
            raise UserError(f"kernels=liger computes the head loss with Liger's fused linear cross-entropy, not in "
                            f"chunks; drop loss_chunk_tokens={cfg.loss_chunk_tokens}, or set kernels=none")
        if cfg.peft.quantize != "none":  # QLoRA builds its one-GPU model apart, without Liger's patches
            raise UserError("kernels=liger does not combine with peft.quantize=4bit (QLoRA's model is built apart, "
                            "for bitsandbytes); drop one of them")
    if cfg.activation_offload and cfg.compile is True:
        raise UserError("activation_offload does not combine with compile (its hooks would run inside compiled "
                        "blocks); drop one of them")
    if cfg.peft.quantize != "none" and (cfg.activation_checkpointing in ("selective", "every_n")
                                        or cfg.activation_offload):
        raise UserError("peft.quantize=4bit (QLoRA) supports activation_checkpointing=full or none and no "
                        "activation_offload; change those settings")


# the Hub's rule for a repo id: namespace/name, letters, digits, - _ . (no -- or .., no leading/trailing - or .,
# no .git ending: huggingface_hub refuses that one itself, after the export or the run it was to upload)
REPO_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?")


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text and not text.endswith(".git")


def is_branch_name(name: str) -> bool:
    """git check-ref-format --branch's rules, which the Hub's branches (git refs) follow."""
    if name in ("@", "HEAD") or name.startswith(("-", "/")) or name.endswith(("/", ".")):
        return False
    if any(bad in name for bad in ("..", "//", "@{", "\\")) or any(c in " ~^:?*[" or not c.isprintable() for c in name):
        return False
    return all(part and not part.startswith(".") and not part.endswith(".lock") for part in name.split("/"))


def _validate_publish(cfg) -> None:
    p = cfg.publish
    if p.wandb_artifacts != "none" and "wandb" not in cfg.log.trackers:
        raise UserError(f"publish.wandb_artifacts={p.wandb_artifacts} logs to W&B; add log.trackers=[wandb] "
                        "or set publish.wandb_artifacts=none")
    if p.hub_repo is None:
        return
    if not is_repo_id(p.hub_repo):
        raise UserError(f"publish.hub_repo={p.hub_repo!r} is not a Hub repo id; write namespace/name "
                        "(letters, digits, - _ .), e.g. publish.hub_repo=my-user/opt-arxiv")
    if not is_branch_name(p.revision):  # else refused by the Hub at the first upload, a warning
        raise UserError(f"publish.revision={p.revision!r} is not a branch name (git's rules: no spaces, "
                        "~ ^ : ? * [ \\, '..', '//' or '@{', no part starting with . or ending in .lock); "
                        "e.g. publish.revision=dev")
    if p.checkpoints and not (cfg.checkpoint.every_steps or cfg.checkpoint.at_epoch_end):
        raise UserError("publish.checkpoints uploads each checkpoint, but none are saved; set "
                        "checkpoint.every_steps=N (or publish.checkpoints=false for the final model only)")
