"""Data: load documents (local files or the HF hub), tokenize once (cached by `datasets`),
pack text into fixed-length blocks (instruct/chat examples stay one per row, see formats.py),
and decide which samples each rank trains on at each step.

The global order of an epoch is a seeded permutation of all packed blocks; optimizer step s
takes the next `global_batch_size` blocks of it, and rank r's micro-batch m inside that step
is a fixed slice of them. The split depends only on (seed, epoch, step, rank, world size), so
any world size trains on exactly the same global batches.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

from . import formats
from .config import DataConfig
from .errors import UserError, first_line
from .formats import IGNORE_INDEX

BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".csv": "csv",
            ".parquet": "parquet"}
VAL_NAMES = ("validation", "valid", "val", "dev")


# ----------------------------------------------------------------------------- documents


def _is_blank(path: Path) -> bool:
    """True for a file with nothing but whitespace (reads only until the first real byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _local_files(path: Path) -> dict[str, list[str]]:
    """Files of a local dataset, by split. A folder's `train*`/`validation*` files are splits."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.suffix in BUILDERS and not p.name.startswith("."))
        if not files:
            raise UserError(f"data.path={str(path)!r} holds no {'/'.join(sorted(BUILDERS))} files; "
                            "point it at a data file or a folder of them")
    blank = [p for p in files if _is_blank(p)]
    if blank:
        raise UserError(f"data file {str(blank[0])!r} is empty (no documents); add documents to it "
                        "or point data.path elsewhere")
    suffixes = {p.suffix for p in files}
    if len({BUILDERS[s] for s in suffixes if s in BUILDERS}) != 1 or not suffixes <= BUILDERS.keys():
        raise UserError(f"data.path={str(path)!r} mixes or has unsupported file types ({', '.join(sorted(suffixes))}); "
                        f"use one of {', '.join(sorted(BUILDERS))}")
    splits: dict[str, list[str]] = {}
    for p in files:
        stem = p.stem.lower()
        split = next((s for s in ("train", *VAL_NAMES, "test") if stem.startswith(s)), "train")
        splits.setdefault("validation" if split in VAL_NAMES else split, []).append(str(p))
    if "train" not in splits:
        splits = {"train": [f for group in splits.values() for f in group]}
    return splits


def load_documents(cfg: DataConfig):
    """DatasetDict-like {split: Dataset} of raw documents."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(cfg.path).expanduser()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are retold as one UserError
    try:
        if path.exists():
            files = _local_files(path)
            builder = BUILDERS[Path(next(iter(files.values()))[0]).suffix]
            return datasets.load_dataset(builder, data_files=files)
        if cfg.path.startswith((".", "/", "~")) or Path(cfg.path).suffix in BUILDERS:
            raise UserError(f"data file {cfg.path!r} not found; check data.path")
        return datasets.load_dataset(cfg.path, cfg.name)
    except UserError:
        raise
    except datasets.exceptions.DatasetGenerationError as exc:  # e.g. a malformed JSON line
        raise UserError(f"could not read dataset {cfg.path!r} ({first_line(exc.__cause__ or exc)}); fix the file "
                        "or point data.path elsewhere") from None
    except (FileNotFoundError, ConnectionError, ValueError) as exc:
        target = f"dataset:{cfg.path}" + (f":{cfg.name}" if cfg.name else "")
        raise UserError(f"could not load dataset {cfg.path!r} ({first_line(exc)}); check data.path/data.name "
                        f"(no network? run `shardtune download {target}` where there is)") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def split_documents(cfg: DataConfig, splits, seed: int):
    """(train, validation) documents: the dataset's own validation split if it has one, else a
    seeded hold-out of `val_size` training documents; then `start_idx:end_idx` of the rest."""
    if cfg.split not in splits:
        raise UserError(f"dataset {cfg.path!r} has no split {cfg.split!r}; choose data.split from "
                        f"{', '.join(splits)}")
    train = splits[cfg.split]
    val_name = cfg.val_split or next((s for s in VAL_NAMES if s in splits and s != cfg.split), None)
    if cfg.val_split and cfg.val_split not in splits:
        raise UserError(f"dataset {cfg.path!r} has no split {cfg.val_split!r}; choose data.val_split from "
                        f"{', '.join(splits)}")
    if val_name is not None:
        val = splits[val_name]
    else:
        n = len(train)
        k = int(cfg.val_size) if cfg.val_size >= 1 else int(round(n * cfg.val_size))
        k = min(k, n - 1) if n > 1 else 0
        import numpy as np

        held = np.random.default_rng(seed).permutation(n)[:k]
        held_set = set(held.tolist())
        val = train.select(sorted(held_set))
        train = train.select([i for i in range(n) if i not in held_set])
    start = cfg.start_idx or 0
    end = len(train) if cfg.end_idx is None else min(cfg.end_idx, len(train))
    if start or end < len(train):
        train = train.select(range(start, end))
    return train, val


# ----------------------------------------------------------------------------- tokens


def pack(docs, tokenizer, field: str, seq_len: int, num_proc: int | None = None):
    """Tokenize, join documents with EOS, and cut into `seq_len` blocks (the tail is dropped)."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch[field], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    # Blank documents (wikitext's empty lines) would only add runs of EOS.
    docs = docs.filter(lambda batch: [bool(t and t.strip()) for t in batch[field]], batched=True,
                       num_proc=num_proc, desc="drop blank")
    tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names, num_proc=num_proc,
                      desc="tokenize")
    return blocks(tokens, seq_len)


def blocks(tokens, seq_len: int):
    """Concatenate every row's `input_ids` (and `labels`, if any) and cut into `seq_len` blocks;
    the tail is dropped. One pass over everything (batch_size=None) so no block straddles a gap."""
    columns = [c for c in ("input_ids", "labels") if c in tokens.column_names]

    def group(batch):
        out = {}
        for c in columns:
            flat = list(chain.from_iterable(batch[c]))
            usable = len(flat) // seq_len * seq_len
            out[c] = [flat[i:i + seq_len] for i in range(0, usable, seq_len)]
        return out

    return tokens.map(group, batched=True, batch_size=None, remove_columns=tokens.column_names,
                      desc=f"pack {seq_len}")


def tokenize_split(docs, cfg: DataConfig, tokenizer, what: str, required: bool = False):
    """Token rows of one split in cfg.format: packed text blocks, or one example per row with
    `labels` (IGNORE_INDEX where there is no loss) and `length`. `required`: an instruct/chat
    split left with no example is a UserError."""
    if cfg.format == "text":
        docs, field = formats.render_text(docs, cfg, what)
        return pack(docs, tokenizer, field, cfg.seq_len, cfg.num_proc)
    make = formats.instruct_fn if cfg.format == "instruct" else formats.chat_fn
    build = make(cfg, tokenizer, docs.column_names, what)
    rows = docs.map(build, batched=True, with_indices=cfg.format == "chat", remove_columns=docs.column_names,
                    num_proc=cfg.num_proc, desc=f"tokenize {cfg.format}")
    # Rows whose loss tokens were all cut off (or that had none) would only cost compute;
    # position 0 is never predicted, hence [1:].
    rows = rows.filter(lambda batch: [any(t != IGNORE_INDEX for t in lab[1:]) for lab in batch["labels"]],
                       batched=True, num_proc=cfg.num_proc, desc="drop rows without loss")
    if required and len(rows) == 0:
        raise UserError(f"no example of {what} keeps a response (or assistant) token within data.cutoff_len="
                        f"{cfg.example_cutoff}; raise data.cutoff_len/data.seq_len or check the data")
    if cfg.train_on_inputs:
        rows = rows.remove_columns("labels")  # labels == input_ids
    if cfg.packing:
        rows = blocks(rows, cfg.seq_len)
    return rows


def prepare(cfg: DataConfig, tokenizer, seed: int):
    """(train, val) torch datasets with `input_ids` (and `labels` where some tokens get no loss).
    text: packed blocks of seq_len; instruct/chat: one example per row, at most cutoff_len long,
    with a `length` column (see `lengths`), unless data.packing."""
    splits = load_documents(cfg)
    train_docs, val_docs = split_documents(cfg, splits, seed)
    if len(train_docs) == 0:
        raise UserError(f"dataset {cfg.path!r} has no training documents (after start_idx/end_idx); "
                        "check data.path and the slice")
    train = tokenize_split(train_docs, cfg, tokenizer, f"dataset {cfg.path!r}", required=True)
    if len(train) == 0:
        raise UserError(f"dataset {cfg.path!r} has fewer tokens than one sequence of data.seq_len={cfg.seq_len}; "
                        "add data or lower data.seq_len")
    val = None
    if len(val_docs):
        val = tokenize_split(val_docs, cfg, tokenizer, f"the validation split of {cfg.path!r}")
        val = val if len(val) else None
    return train.with_format("torch"), (val.with_format("torch") if val is not None else None)


def lengths(ds) -> list[int] | None:
    """Per-sample token counts for BatchPlan(lengths=...), or None for packed (equal) blocks."""
    if "length" not in ds.column_names:
        return None
    return ds.with_format("numpy", columns=["length"])[:]["length"].tolist()


# ----------------------------------------------------------------------------- batches


class BatchPlan:
    """Which samples rank `rank` uses for every micro-step of every optimizer step.

    With `lengths` (group_by_length), each epoch's shuffled order is cut into mega-chunks of
    GROUP_BATCHES global batches, each chunk is sorted longest first, and then the global
    batches are shuffled: micro-batches hold similar lengths (little padding) while the
    order of batches stays random. Like the plain order, it depends on (seed, epoch) only."""

    GROUP_BATCHES = 50

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int, world_size: int,
                 rank: int, seed: int, lengths=None):
        self.num_samples, self.global_batch, self.micro_batch = num_samples, global_batch, micro_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
        self.lengths = lengths
        self.accum = global_batch // (micro_batch * world_size)
        self.steps_per_epoch = num_samples // global_batch
        if self.steps_per_epoch == 0:
            raise UserError(f"the training split has {num_samples} sequences, fewer than "
                            f"train.global_batch_size={global_batch}; lower the batch size or data.seq_len")
        self._epoch, self._order = -1, None

    def order(self, epoch: int):
        import torch

        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=gen)
            if self.lengths is not None:
                order = self._grouped(order, gen)
            self._epoch, self._order = epoch, order
        return self._order

    def _grouped(self, order, gen):
        import torch

        lengths = torch.as_tensor(self.lengths)[order]
        chunk = self.GROUP_BATCHES * self.global_batch
        parts = []
        for start in range(0, self.num_samples, chunk):
            by_len = torch.sort(lengths[start:start + chunk], descending=True, stable=True).indices
            parts.append(order[start:start + chunk][by_len])
        order = torch.cat(parts)
        usable = self.steps_per_epoch * self.global_batch
        batches = order[:usable].view(self.steps_per_epoch, self.global_batch)
        shuffled = batches[torch.randperm(self.steps_per_epoch, generator=gen)].reshape(-1)
        return torch.cat([shuffled, order[usable:]])  # the tail is not trained on this epoch

    def micro_batches(self, epoch: int, step_in_epoch: int) -> list[list[int]]:
        """`accum` lists of `micro_batch` sample indices for this rank at this step."""
        order = self.order(epoch)
        base = step_in_epoch * self.global_batch
        out = []
        for m in range(self.accum):
            start = base + (m * self.world_size + self.rank) * self.micro_batch
            out.append(order[start:start + self.micro_batch].tolist())
        return out


def eval_batches(num_samples: int, micro_batch: int, world_size: int, rank: int,
                 max_batches: int = 0) -> list[list[int]]:
    """Validation blocks for this rank in fixed order. Every rank gets the same number of
    batches (FSDP needs every rank in every forward); missing places are -1 (masked).
    `max_batches` caps the sequences at max_batches x micro_batch, the same set for any world size."""
    if max_batches:
        num_samples = min(num_samples, max_batches * micro_batch)
    per_round = micro_batch * world_size
    rounds = -(-num_samples // per_round)
    batches = []
    for r in range(rounds):
        start = r * per_round + rank * micro_batch
        batches.append([i if i < num_samples else -1 for i in range(start, start + micro_batch)])
    return batches


def collate(ds, indices: list[int], device, pad_id: int = 0):
    """{input_ids, labels} tensors for these samples; index -1 is a padding row with no loss.
    Rows of different lengths are right-padded with `pad_id` (labels with IGNORE_INDEX) to the
    longest, and only then is an `attention_mask` (1 = real token) added."""
    import torch

    real = [i if i >= 0 else 0 for i in indices]
    rows = ds[real]
    input_ids = rows["input_ids"]
    labels = rows.get("labels")
    if isinstance(input_ids, torch.Tensor):  # equal lengths: datasets stacked them already
        labels = labels.clone() if labels is not None else input_ids.clone()
        mask = None
    else:
        labels = labels if labels is not None else input_ids
        width = max(len(x) for x in input_ids)
        padded = torch.full((len(real), width), pad_id, dtype=input_ids[0].dtype)
        mask = torch.zeros((len(real), width), dtype=torch.long)
        padded_labels = torch.full((len(real), width), IGNORE_INDEX, dtype=input_ids[0].dtype)
        for pos, (ids, lab) in enumerate(zip(input_ids, labels)):
            padded[pos, :len(ids)], padded_labels[pos, :len(ids)], mask[pos, :len(ids)] = ids, lab, 1
        input_ids, labels = padded, padded_labels
    for pos, i in enumerate(indices):
        if i < 0:
            labels[pos] = IGNORE_INDEX
    batch = {"input_ids": input_ids.to(device, non_blocking=True), "labels": labels.to(device, non_blocking=True)}
    if mask is not None:
        batch["attention_mask"] = mask.to(device, non_blocking=True)
    return batch
