"""Data: load documents (local files or the HF hub), split off validation, tokenize once (cached
by `datasets`) and pack text into fixed-length blocks (instruct/chat examples stay one per row,
see formats.py). Which of them each rank trains on at each step: batches.py."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from pathlib import Path

from shardtune.config.schema import DataConfig
from shardtune.data import chat, formats
from shardtune.data.files import VAL_NAMES, by_split, data_files, read_path
from shardtune.data.formats import IGNORE_INDEX
from shardtune.data.layouts import builder_of, is_saved
from shardtune.diskspace import no_room
from shardtune.errors import UserError, first_line
from shardtune.fsio import broken_link
from shardtune.names import hub_id

# ----------------------------------------------------------------------------- documents


def load_documents(cfg: DataConfig):
    """DatasetDict-like {split: Dataset} of raw documents."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(cfg.path).expanduser()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are retold as one UserError
    try:
        if path.exists():
            return read_path(path, cfg.path, say=_warn, columns=tuple(c for c, _, _ in formats.read_columns(cfg)))
        if any(c in cfg.path for c in "*?["):  # a shell would have expanded it; a recipe's value is not
            raise UserError(f"data.path={cfg.path!r} is a pattern, and shardtune reads no patterns; point data.path "
                            "at the folder that holds the files (its train* and validation* files are the splits)")
        if (link := broken_link(path)) is not None:
            raise UserError(f"data.path={cfg.path!r} is {link}; fix the link, or point data.path elsewhere")
        if hub_id(cfg.path) is None or builder_of(cfg.path):  # a path not there: nothing to download
            raise UserError(f"data file {cfg.path!r} not found; check data.path")
        return datasets.load_dataset(cfg.path, cfg.name)
    except UserError:
        raise
    except datasets.exceptions.DatasetGenerationError as exc:  # e.g. a malformed JSON line
        if no_room(exc, 0, None):
            raise  # not the file's fault: prepare() tells a full disk
        why = " ".join(str(exc.__cause__ or exc).split())[:300] or type(exc).__name__  # a cast's types span lines
        raise UserError(f"could not read dataset {cfg.path!r} ({why}); fix the file or point data.path "
                        "elsewhere") from None
    except (FileNotFoundError, ConnectionError, ValueError) as exc:
        target = f"dataset:{cfg.path}" + (f":{cfg.name}" if cfg.name else "")
        raise UserError(f"could not load dataset {cfg.path!r} ({first_line(exc)}); check data.path/data.name "
                        f"(no network? run `shardtune download {target}` where there is)") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def validation_split(cfg: DataConfig, splits) -> str | None:
    """The dataset's split used for validation, or None when it is carved out of the training split."""
    return cfg.val_split or next((s for s in VAL_NAMES if s in splits and s != cfg.split), None)


def split_files(cfg: DataConfig, split: str | None) -> str:
    """' (FILES)' naming a local folder's files of `split`, for messages about its columns; '' otherwise
    (a single file is already named by data.path, a hub dataset has no local files)."""
    path = Path(cfg.path).expanduser()
    if split is None or not path.is_dir() or is_saved(path):
        return ""
    files = by_split(data_files(path)).get(split, [])  # named, not checked again: load_documents did
    return f" ({', '.join(Path(f).name for f in files)})" if files else ""


# The hold-out's shuffle: fixed, not train.seed's. A sweep over seeds (`--grid train.seed=1,2,3`)
# compared losses on different validation documents, trained on different documents too.
HOLD_OUT_SEED = 0


def split_documents(cfg: DataConfig, splits):
    """(train, validation) documents: the dataset's own validation split if it has one, else a
    hold-out of `val_size` training documents (the same whatever the run's seed); then
    `start_idx:end_idx` of the rest."""
    train, val, _ = _split(cfg, splits)
    return train, val


def _split(cfg: DataConfig, splits):
    """split_documents, and (what, fix) for what took training documents away (the hold-out, the
    slice): a refusal of a training split too small to use names its cause, not its symptom."""
    if cfg.split not in splits:
        raise UserError(f"dataset {cfg.path!r} has no split {cfg.split!r}; choose data.split from "
                        f"{', '.join(splits)}")
    train = splits[cfg.split]
    val_name = validation_split(cfg, splits)
    if cfg.val_split and cfg.val_split not in splits:
        raise UserError(f"dataset {cfg.path!r} has no split {cfg.val_split!r}; choose data.val_split from "
                        f"{', '.join(splits)}")
    causes = []
    if val_name is not None:
        val = splits[val_name]
    else:
        n = len(train)
        k = int(cfg.val_size) if cfg.val_size >= 1 else int(round(n * cfg.val_size))
        if k and k >= n:
            raise UserError(f"data.val_size={cfg.val_size:g} holds out {k} document(s) for validation but "
                            f"dataset {cfg.path!r} has only {n}; lower data.val_size (a count, or a fraction "
                            "below 1) or add data")
        import numpy as np

        held = np.zeros(n, dtype=bool)  # index arrays, not Python lists: 1 byte a document, not ~40
        held[np.random.default_rng(HOLD_OUT_SEED).permutation(n)[:k]] = True
        val, train = train.select(np.flatnonzero(held)), train.select(np.flatnonzero(~held))
        if k:
            causes.append((f"data.val_size={cfg.val_size:g} held out {k} of its {n} documents", "lower data.val_size"))
    start = cfg.start_idx or 0
    end = len(train) if cfg.end_idx is None else min(cfg.end_idx, len(train))
    if start or end < len(train):
        causes.append((f"data.start_idx:end_idx kept {max(end - start, 0)} of {len(train)}", "widen the slice"))
        train = train.select(range(start, end) if start < end else [])  # datasets refuses range(n, n)
    return train, val, causes


def too_small(causes: list[tuple[str, str]], remedy: str) -> str:
    """The end of a refusal of a training split too small to use: what made it so, and the fix."""
    if not causes:
        return f"; {remedy}"
    return f" ({'; '.join(c for c, _ in causes)}); {', '.join(f for _, f in causes)}, or {remedy}"


# ----------------------------------------------------------------------------- tokens


def pack(docs, tokenizer, field: str, seq_len: int, num_proc: int | None = None, document_mask: bool = False):
    """Tokenize, join documents with EOS, and cut into `seq_len` blocks (the tail is dropped),
    out of core (packing.py)."""
    from shardtune.data.packing import pack_text

    return pack_text(docs, tokenizer, field, seq_len, num_proc, document_mask)


_retell: ContextVar = ContextVar("retell", default=None)


@contextlib.contextmanager
def warnings_retold(words):
    """Every warning and note printed inside passes through `words(line)` first: a command that has
    no data.* keys (eval) names its own options in them, as in its refusals."""
    token = _retell.set(words)
    try:
        yield
    finally:
        _retell.reset(token)


def _warn(line: str) -> None:
    import sys

    from shardtune.distributed.process_group import is_main_process

    if (words := _retell.get()) is not None:
        line = words(line)
    if is_main_process():
        print(line, file=sys.stderr, flush=True)


def label_code() -> str:
    """A hash of the code that turns instruct and chat rows into tokens and labels (data/code_key.py)."""
    from shardtune.data import messages
    from shardtune.data.code_key import code_hash

    return code_hash(formats, chat, messages)


def tokenize_split(docs, cfg: DataConfig, tokenizer, what: str, warn=None, required: bool = False):
    """Token rows of one split in cfg.format: packed text blocks, or one example per row with
    `labels` (IGNORE_INDEX where there is no loss) and `length`. `required`: an instruct/chat
    split left with no example is a UserError."""
    formats.check_cells(docs, cfg, what, warn or _warn, tokenizer)
    if cfg.format == "text":
        docs, field = formats.render_text(docs, cfg, what)
        return pack(docs, tokenizer, field, cfg.seq_len, cfg.num_proc, cfg.masks_documents)
    from datasets.fingerprint import Hasher

    make = formats.instruct_fn if cfg.format == "instruct" else chat.chat_fn
    build = make(cfg, tokenizer, docs.column_names, what)
    chats = cfg.format == "chat"
    rows = docs.map(build, batched=True, with_indices=chats, remove_columns=docs.column_names,
                    num_proc=cfg.num_proc, desc=f"tokenize {cfg.format}",
                    new_fingerprint=Hasher.hash((docs._fingerprint, build, chats, label_code())))
    # Rows whose loss tokens were all cut off (or that had none) would only cost compute;
    # position 0 is never predicted, hence [1:].
    examples = len(rows)
    rows = rows.filter(lambda batch: [any(t != IGNORE_INDEX for t in lab[1:]) for lab in batch["labels"]],
                       batched=True, num_proc=cfg.num_proc, desc="drop rows without loss")
    key = "data.cutoff_len" if cfg.cutoff_len else "data.seq_len"  # the one that set the cutoff
    if 0 < len(rows) < examples:  # said, not dropped silently (none left: refused below, or _prepare says so)
        turns = "assistant (role assistant, or ShareGPT's gpt)" if cfg.format == "chat" else "response"
        (warn or _warn)(f"warning: {examples - len(rows)} of {examples} examples of {what} are left out: they have no "
                        f"{turns} token within {key}={cfg.example_cutoff} (cut off, or none at all)")
    if required and len(rows) == 0:
        if cfg.format == "chat" and not cfg.train_on_inputs and not chat.any_assistant_turn(docs, cfg):
            raise UserError(f"no conversation of {what} has an assistant turn (role assistant, or ShareGPT's gpt), "
                            "the only turns with a loss; give the conversations their replies, or check "
                            "data.messages_field")
        raise UserError(f"no example of {what} keeps a response (or assistant) token within {key}="
                        f"{cfg.example_cutoff}; raise {key} or check the data")
    cut = _count(rows, "cut")
    rows = rows.remove_columns("cut")
    if cut:  # the ends of responses, and the EOS (or end of turn) that teaches the model to stop, go untrained
        (warn or _warn)(f"warning: {cut} of {len(rows)} examples of {what} are cut at {key}={cfg.example_cutoff} "
                        f"tokens before the end of their {'replies' if cfg.format == 'chat' else 'responses'}: "
                        f"their ends, and the end of turn or EOS, have no loss; raise {key} to keep them whole")
    if cfg.train_on_inputs:
        rows = rows.remove_columns("labels")  # labels == input_ids
    if cfg.packing:
        from shardtune.data.packing import pack_rows, token_dtype

        return pack_rows(rows, cfg.seq_len, token_dtype(tokenizer), cfg.masks_documents)
    return rows


def _count(rows, column: str) -> int:
    """How many rows of a boolean column are true, read a chunk at a time."""
    import pyarrow.compute as pc

    from shardtune.data.scan import ArrowChunks

    return sum(pc.sum(chunk.column(column), min_count=0).as_py() for chunk in ArrowChunks(rows, [column]))


def same_on_every_rank(dist, splits: dict) -> None:
    """Refuse alike on every rank where the ranks prepared different data (`splits`: name -> the
    prepared split, or None). Each rank prepares its own (rank 0 first, the others from their
    node's cache): a node whose copy of data.path or of the tokenizer differed, or a file rewritten
    while the ranks started, trained those ranks on other samples than the plan's, or hung where
    their counts of steps or validation batches differed. Compared: each split's sequence count and
    a hash of its first, middle and last sequence, and of every example's length (a column; packed
    blocks shift after any edit that changes a length), not the corpus."""
    import hashlib

    import numpy as np

    from shardtune.data.batches import sample_lengths
    from shardtune.distributed import collectives

    if dist.world_size == 1:
        return
    seen = {}
    for name, ds in splits.items():
        n, digest = len(ds) if ds is not None else 0, hashlib.sha256()
        digest.update(np.asarray(n and sample_lengths(ds) or [], dtype=np.int64).tobytes())
        for i in sorted({0, n // 2, n - 1}) if n else ():
            row = ds[i]
            for key in sorted(row):
                digest.update(key.encode() + np.asarray(row[key], dtype=np.int64).tobytes())
        seen[f"{name} sequences"], seen[f"{name} tokens (a hash)"] = n, digest.hexdigest()[:16]
    collectives.same_on_every_rank(dist, seen, "each rank reads data.path and the tokenizer on its own node: give "
                                   "every node the same files, unchanged while a run starts", "read different data")


def prepare(cfg: DataConfig, tokenizer, global_batch: int = 1):
    """(train, val) torch datasets with `input_ids` (and `labels` where some tokens get no loss).
    text: packed blocks of seq_len; instruct/chat: one example per row, at most cutoff_len long,
    with a `length` column (see `lengths`), unless data.packing. A training split of fewer than
    `global_batch` sequences is refused here, where what made it small is known."""
    notes: list[str] = []
    try:
        prepared = _prepare(cfg, tokenizer, notes.append, global_batch)
    except Exception as exc:  # no room for the `datasets` cache or the packed blocks beside it: one line
        if (why := no_room(exc, 0, None)) is None:
            raise
        import datasets

        raise UserError(f"{why} while caching the data under {datasets.config.HF_DATASETS_CACHE}; free space "
                        "there, or point HF_DATASETS_CACHE (or HF_HOME) at a disk with room, and run again") from None
    for line in notes:  # only once the data is usable: a refusal stays one line
        _warn(line)
    return prepared


def _prepare(cfg: DataConfig, tokenizer, warn, global_batch: int = 1):
    splits = load_documents(cfg)
    train_docs, val_docs, causes = _split(cfg, splits)
    if not len(val_docs) and cfg.val_size and validation_split(cfg, splits) is None:  # a fraction that rounds to 0
        warn(f"warning: data.val_size={cfg.val_size:g} of the {len(splits[cfg.split])} training documents of "
             f"{cfg.path!r} holds out none; this run validates nothing (hold out a count: data.val_size=1)")
    if len(train_docs) == 0:
        raise UserError(f"dataset {cfg.path!r} has no training documents left"
                        + too_small(causes, "check data.path"))
    train = tokenize_split(train_docs, cfg, tokenizer, f"dataset {cfg.path!r}{split_files(cfg, cfg.split)}", warn,
                           required=True)
    if cfg.format == "chat" and (line := chat.unended_turns(cfg, tokenizer)):
        warn(line)
    if len(train) == 0:
        raise UserError(f"dataset {cfg.path!r} has fewer tokens than one sequence of data.seq_len="
                        f"{cfg.seq_len}" + too_small(causes, "add data or lower data.seq_len"))
    if len(train) < global_batch:
        raise UserError(f"the training split of {cfg.path!r} has {len(train)} sequences, fewer than "
                        f"train.global_batch_size={global_batch}"
                        + too_small(causes, "lower the batch size or data.seq_len, or add data"))
    val = None
    if len(val_docs):
        what = f"the validation split of {cfg.path!r}{split_files(cfg, validation_split(cfg, splits))}"
        val = tokenize_split(val_docs, cfg, tokenizer, what, warn)
        if not len(val):  # the run goes on, but the user asked for validation: said, not dropped silently
            short = (f"fewer tokens than one sequence of data.seq_len={cfg.seq_len}" if cfg.format == "text" or
                     cfg.packing else f"no example with a loss token within {cfg.example_cutoff} tokens")
            warn(f"warning: {what} has {short}; this run validates nothing (add validation documents, or lower "
                 "data.seq_len)")
            val = None
    return train.with_format("torch"), (val.with_format("torch") if val is not None else None)
