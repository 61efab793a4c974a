"""Out-of-core packing: token ids streamed once into flat files on disk, blocks read from them.

Documents are tokenized a chunk at a time (in this process, where a fast tokenizer uses every
core itself, or in `data.num_proc` worker processes) and appended to one flat file of token
ids, beside the offset where every document starts. Block i is ids[i*seq_len:(i+1)*seq_len] of
that file (one positioned read), so memory does not grow with the corpus and the blocks are
exactly those of concatenating everything and cutting (the tail is dropped). The files sit beside the
dataset's own cache under a key of the documents, the tokenizer and the settings (not seq_len:
one tokenization serves every block size), so a second run and the other ranks open them at once.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import deque
from pathlib import Path

from shardtune.data import docmask
from shardtune.data.formats import IGNORE_INDEX, leading_bos
from shardtune.data.scan import CHUNK_ROWS, ArrowChunks
from shardtune.fsio import json_loads

FORMAT_VERSION = 1  # bump when the files' layout or content changes


# ----------------------------------------------------------------------------- the blocks


class PackedBlocks:
    """`seq_len` blocks over a folder of flat arrays, read like a torch-formatted dataset:
    `blocks[i]` is {input_ids[, labels][, position_ids]} of one block, `blocks[list or slice]`
    the same stacked. With `document_mask`, positions restart at every document and a
    document's first token gets no label (nothing is predicted across a document boundary).
    A block is one positioned read of the files (no memory map: an epoch over a corpus larger
    than memory leaves no pages counted in the resident set)."""

    def __init__(self, folder: Path, seq_len: int, document_mask: bool = False, owned: bool = False):
        import weakref

        import numpy as np

        self.folder, self.seq_len, self.document_mask = Path(folder), seq_len, document_mask
        meta = json_loads((self.folder / "meta.json").read_text())
        self.num_tokens = meta["num_tokens"]
        self.dtypes = {"input_ids": np.dtype(meta["dtype"])}
        if meta["labels"]:
            self.dtypes["labels"] = np.dtype(np.int32)
        self.fds = {name: os.open(self.folder / f"{name}.bin", os.O_RDONLY) for name in self.dtypes}
        starts = self.folder / "doc_starts.bin"  # searched, not read whole: mapped
        self.doc_starts = np.memmap(starts, np.int64, "r") if starts.stat().st_size else np.empty(0, np.int64)
        weakref.finalize(self, _close, list(self.fds.values()), str(self.folder) if owned else None)

    @property
    def column_names(self) -> list[str]:
        names = ["input_ids"]
        if "labels" in self.dtypes or self.document_mask:
            names.append("labels")
        return names + (["position_ids"] if self.document_mask else [])

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def with_format(self, *args, **kwargs) -> PackedBlocks:
        return self  # always torch tensors

    def block(self, i: int) -> dict:
        """Numpy arrays of block i."""
        import numpy as np

        if not 0 <= i < len(self):
            raise IndexError(f"block {i} of {len(self)}")
        start, end = i * self.seq_len, (i + 1) * self.seq_len
        out = {"input_ids": self._read("input_ids", start)}
        labels = self._read("labels", start) if "labels" in self.dtypes else None
        if self.document_mask:
            inside = self.doc_starts[np.searchsorted(self.doc_starts, start, side="right"):
                                     np.searchsorted(self.doc_starts, end, side="left")] - start
            out["position_ids"] = docmask.positions(inside, self.seq_len)
            labels = out["input_ids"].copy() if labels is None else labels
            labels[inside] = IGNORE_INDEX
        if labels is not None:
            out["labels"] = labels
        return out

    def documents(self, i: int) -> tuple[int, int]:
        """(first, last) number of the documents block i holds text of, counted from 0 in the order
        they were packed (the training split's non-blank documents)."""
        import numpy as np

        start, end = i * self.seq_len, (i + 1) * self.seq_len
        first, last = np.searchsorted(self.doc_starts, [start, end - 1], side="right") - 1
        return max(int(first), 0), max(int(last), 0)

    def __getitem__(self, key):
        import numpy as np
        import torch

        if isinstance(key, (int, np.integer)):
            return {k: torch.from_numpy(v) for k, v in self.block(int(key)).items()}
        indices = range(len(self))[key] if isinstance(key, slice) else [int(i) for i in key]
        if not indices:
            return {"input_ids": torch.empty((0, self.seq_len), dtype=torch.int64)}
        rows = [self.block(i) for i in indices]
        return {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def _read(self, name: str, start: int):
        """int64 numpy array of the seq_len values of file `name` from token `start` on."""
        import numpy as np

        dtype = self.dtypes[name]
        data = os.pread(self.fds[name], self.seq_len * dtype.itemsize, start * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype).astype(np.int64)


def equal_blocks(ds) -> bool:
    """Whether every row of `ds` is a block of one length whose every position after the first is
    predicted: packed text, or packed instruct/chat trained on its inputs (no labels of its own, no
    `length` column). Only then may a training step take its tokens with a loss for global batch x
    (block - 1) without counting them; every other dataset's rows have lengths of their own (one
    row to a micro-batch is never padded) or tokens without a loss, and are counted (step.train_step)."""
    return not {"labels", "length"} & set(ds.column_names)


def _close(fds: list[int], folder: str | None) -> None:
    for fd in fds:
        os.close(fd)
    if folder is not None:  # a temporary folder (data without a cache of its own) goes with its blocks
        shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- writing


class _Writer:
    """Appends chunks of ids (and labels) and document lengths to flat files in `folder`."""

    def __init__(self, folder: Path, dtype: str, labels: bool):
        self.folder, self.dtype, self.num_tokens = folder, dtype, 0
        self.ids = open(folder / "input_ids.bin", "wb")
        self.labels = open(folder / "labels.bin", "wb") if labels else None
        self.starts = open(folder / "doc_starts.bin", "wb")

    def add(self, ids, lengths, labels=None) -> None:
        import numpy as np

        self.starts.write((np.cumsum(lengths) - lengths + self.num_tokens).astype(np.int64).tobytes())
        self.ids.write(ids.astype(self.dtype, copy=False).tobytes())
        if self.labels is not None:
            self.labels.write(labels.astype(np.int32, copy=False).tobytes())
        self.num_tokens += len(ids)

    def close(self) -> None:
        for f in (self.ids, self.labels, self.starts):
            if f is not None:
                f.close()
        meta = {"num_tokens": self.num_tokens, "dtype": self.dtype, "labels": self.labels is not None,
                "version": FORMAT_VERSION}
        (self.folder / "meta.json").write_text(json.dumps(meta))


def _cached(dataset, key_parts: tuple, fill, labels: bool, dtype: str) -> tuple[Path, bool]:
    """(folder, owned): the finished folder for this key, written by `fill(writer)` unless an
    earlier run (or rank) already did. Written under a temporary name and renamed when whole; an
    exception or Ctrl-C removes the temporary folder, and one whose process was killed (SIGTERM,
    SIGKILL) is removed by the next preparation in the same cache."""
    from datasets.fingerprint import Hasher

    from shardtune.data.code_key import code_hash

    # and the code that writes the files: a fix to it is not served from an earlier cache (code_key.py)
    key = Hasher.hash((FORMAT_VERSION, code_hash(sys.modules[__name__]), dataset._fingerprint, *key_parts))
    parent = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
    folder = parent / f"shardtune-tokens-{key}" if parent is not None else None
    if folder is not None and (folder / "meta.json").is_file():
        return folder, False
    lock = None
    try:
        if parent is None:
            raise OSError("no cache folder")
        _remove_abandoned(parent)
        tmp, lock = _locked_tmp(parent, f"shardtune-tokens-{key}.tmp-")
    except OSError:  # a read-only dataset cache (or none): keep the tokens for this process only
        folder, tmp = None, Path(tempfile.mkdtemp(prefix="shardtune-tokens-"))
    try:
        writer = _Writer(tmp, dtype, labels)
        fill(writer)
        writer.close()
        if folder is None:
            return tmp, True
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same folder first
            shutil.rmtree(tmp, ignore_errors=True)
        return folder, False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _locked_tmp(parent: Path, prefix: str) -> tuple[Path, int]:
    """(a new temporary folder in parent, a descriptor that holds an exclusive lock on it): the
    kernel drops the lock when this process ends, however it ends, which marks the folder abandoned."""
    import fcntl

    while True:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        lock = os.open(tmp, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tmp.is_dir():
            return tmp, lock
        os.close(lock)  # found abandoned and removed between its creation and the lock: again


def _remove_abandoned(parent: Path) -> None:
    """Remove the temporary token folders in `parent` that no process holds a lock on: left by a
    preparation that was killed (one still being written is locked by its writer)."""
    import fcntl

    for tmp in parent.glob("shardtune-tokens-*.tmp-*"):
        try:
            lock = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue  # gone already
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # its writer is alive
        finally:
            os.close(lock)


# ----------------------------------------------------------------------------- text


def token_dtype(tokenizer) -> str:
    return "uint16" if max(len(tokenizer), tokenizer.vocab_size) <= 1 << 16 else "uint32"


def encode(texts: list, tokenizer, eos: int, dtype: str, bos: list[int] = ()):
    """(flat ids, document lengths) of the non-blank `texts`, each after `bos` (the BOS a llama-style
    tokenizer puts before text, as its model was trained: formats.leading_bos) and followed by EOS,
    neither doubled where the text writes it (formats.with_ends). `bos` is [] or [id]."""
    from itertools import chain

    import numpy as np

    texts = [t for t in texts if t and t.strip()]  # blank documents (wikitext's empty lines) would add only EOS
    if not texts:
        return np.empty(0, dtype=dtype), np.empty(0, dtype=np.int64)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    # with_ends' rule, laid out in numpy: a list per document would double the time of this step
    heads = np.fromiter((bool(bos) and x[:1] != list(bos) for x in ids), dtype=bool, count=len(ids))
    tails = np.fromiter((x[-1:] != [eos] for x in ids), dtype=bool, count=len(ids))
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + heads + tails
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    bos_at, eos_at = (ends - lengths)[heads], (ends - 1)[tails]
    body = np.ones(len(out), dtype=bool)
    body[bos_at] = body[eos_at] = False
    out[body] = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(body.sum()))
    out[bos_at], out[eos_at] = (bos[0] if bos else 0), eos
    return out, lengths


_WORKER: dict = {}


def _worker_init(docs, field: str, tokenizer, eos: int, dtype: str, in_worker: bool = True) -> None:
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the worker processes are the parallelism
    _WORKER.update(chunks=ArrowChunks(docs, [field]), field=field, tokenizer=tokenizer, eos=eos, dtype=dtype,
                   bos=leading_bos(tokenizer))


def _worker_encode(i: int):
    w = _WORKER
    texts = w["chunks"][i].column(w["field"]).to_pylist()
    return encode(texts, w["tokenizer"], w["eos"], w["dtype"], w["bos"])


def _encoded_chunks(docs, field: str, tokenizer, num_proc: int | None, dtype: str):
    """(ids, lengths) of every chunk of documents, in order."""
    eos = tokenizer.eos_token_id
    numbers = range(-(-len(docs) // CHUNK_ROWS))  # of the chunks
    if not num_proc or num_proc <= 1:
        _worker_init(docs, field, tokenizer, eos, dtype, in_worker=False)  # the tokenizer's own threads
        try:
            yield from map(_worker_encode, numbers)
        finally:
            _WORKER.clear()
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: forking a process whose tokenizer already runs threads can deadlock
    with ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                             initargs=(docs, field, tokenizer, eos, dtype)) as pool:
        pending: deque = deque()
        for i in numbers:  # a bounded window of chunks in flight keeps memory flat
            pending.append(pool.submit(_worker_encode, i))
            if len(pending) >= 4 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def pack_text(docs, tokenizer, field: str, seq_len: int, num_proc: int | None = None,
              document_mask: bool = False) -> PackedBlocks:
    """Tokenize docs[field], join the documents with EOS (each after its BOS, where the tokenizer
    puts one before text) and cut into `seq_len` blocks."""
    dtype = token_dtype(tokenizer)

    def fill(writer: _Writer) -> None:
        for ids, lengths in _encoded_chunks(docs, field, tokenizer, num_proc, dtype):
            writer.add(ids, lengths)

    # the BOS itself keyed (formats' rule, outside this module's code hash), as the EOS is
    ends = (leading_bos(tokenizer), tokenizer.eos_token_id)
    folder, owned = _cached(docs, ("text", field, *ends, tokenizer), fill, False, dtype)
    return PackedBlocks(folder, seq_len, document_mask, owned)


# ----------------------------------------------------------------------------- token rows


def pack_rows(rows, seq_len: int, dtype: str, document_mask: bool = False) -> PackedBlocks:
    """Concatenate rows of `input_ids` (and `labels`, if any: instruct/chat examples), one
    document each, and cut into `seq_len` blocks. Reads arrow batches: no Python lists."""
    import pyarrow.compute as pc

    has_labels = "labels" in rows.column_names

    def fill(writer: _Writer) -> None:
        for chunk in ArrowChunks(rows, ["input_ids", "labels"] if has_labels else ["input_ids"]):
            ids = pc.list_flatten(chunk.column("input_ids")).to_numpy()
            lengths = pc.list_value_length(chunk.column("input_ids")).to_numpy().astype("int64")
            labels = pc.list_flatten(chunk.column("labels")).to_numpy() if has_labels else None
            writer.add(ids, lengths, labels)

    folder, owned = _cached(rows, ("rows",), fill, has_labels, dtype)
    return PackedBlocks(folder, seq_len, document_mask, owned)
