"""The files of a local dataset: which are its splits, and that each is a regular, non-empty,
UTF-8 file that the `datasets` readers can take without crashing (checked before any is read,
decompressed where it is compressed); then their reading, where a reader's refusal is the
file's fault. A folder that save_to_disk wrote is read as it was saved. Formats: layouts.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardtune.data.kinds import check_kinds, columns_in_one_row
from shardtune.data.layouts import (
    builder_of,
    is_saved,
    kind_of,
    opened,
    read_saved,
    shown_suffix,
    supported,
    unread_data,
)
from shardtune.errors import UserError, first_line
from shardtune.fsio import broken_link, json_loads

VAL_NAMES = ("validation", "valid", "val", "dev")


def _is_blank(path: Path) -> bool:
    """True for a file with nothing but whitespace (reads only until the first real byte)."""
    with opened(path) as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


CHECK_CHUNK = 1 << 20  # bytes read at a time by the checks of a text file
_BARE_NULL = re.compile(rb"(?m)^[ \t\r]*null[ \t\r]*$")
_INNER_BOM = re.compile(b"[\r\n]\xef\xbb\xbf")


def _check_text_file(path: Path, json_lines: bool, boms: bool = False) -> None:
    """One pass over a text data file before `datasets` reads it: every byte must be UTF-8 (pyarrow
    takes invalid bytes into string columns unchecked, and they fail later, mid-tokenization), and
    no JSON record may be a bare `null` (pyarrow 22's JSON reader crashes the process on one).
    `boms`: no line but the first may start with a byte-order mark (files joined with `cat`, each
    saved by a Windows editor): the reader strips the file's own, and a later one stayed the first
    character of its document (the JSON reader refuses one itself).
    A chunk at a time, decoded incrementally (a character may straddle two chunks); the line a
    chunk ends in is carried only while it may still be a `null` line: a file of one
    long line (a JSON array as json.dump writes it) was copied again with every chunk, quadratic
    time (100 MB: 3 s, 2 GB: 20 min)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset, tail, last = 1, 0, b"", b""  # line: the number of the line the next chunk starts in
    with opened(path) as f:
        while True:
            chunk = f.read(CHECK_CHUNK)
            held = len(decoder.getstate()[0])  # bytes of a character the last chunk began
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                bad_line = line + chunk.count(b"\n", 0, max(exc.start - held, 0))
                raise UserError(f"data file {str(path)!r} is not UTF-8 text (line {bad_line}, byte "
                                f"{offset - held + exc.start}); re-save it as UTF-8") from None
            if boms and (m := _INNER_BOM.search(last + chunk)):  # `last`: a BOM may straddle two chunks
                where = line + chunk.count(b"\n", 0, max(m.start() - len(last) + 1, 0))
                raise UserError(f"data file {str(path)!r} line {where} starts with a byte-order mark (files joined "
                                "with cat?), which would stay the first character of its document; remove it")
            data = tail + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)  # whole lines only: `null` may go on (`nullable`)
            if json_lines and (m := _BARE_NULL.search(data, 0, cut)):
                where = line + data.count(b"\n", 0, m.start())
                raise UserError(f"data file {str(path)!r} line {where} is `null`, not a JSON record; remove it or "
                                'write it as {"text": ...}')
            if not chunk:
                return
            line, offset, tail, last = line + chunk.count(b"\n"), offset + len(chunk), data[cut:], (last + chunk)[-3:]
            if tail.strip(b" \t\r") not in (b"", b"n", b"nu", b"nul", b"null"):
                tail = b"x"  # a line that can no longer be `null`; the next chunk does not start a line


def _check_csv_header(path: Path) -> None:
    """A csv header that names a column twice: the reader renames the second (`text.1`), so the
    run would read the first without a word. A first row with more fields than the header: the
    reader takes the extra leading fields as an index and shifts every column onto its neighbour's
    name. Both records are read as the reader reads them, of any length (the csv module's limit of
    128 KiB a field, which pandas does not have, failed a long first document with a traceback)."""
    import csv

    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(2**31 - 1)  # C long's most on every platform
        with opened(path, text=True) as f:
            records = csv.reader(f, delimiter=kind_of(path).format.kwargs.get("sep", ","))
            header, first = next(records, []), next(records, [])
    finally:
        csv.field_size_limit(limit)
    if len(first) > len(header):
        raise UserError(f"data file {str(path)!r}: its first row has {len(first)} fields but its header names "
                        f"{len(header)} columns (the reader would shift the columns onto the wrong names); quote "
                        "fields that hold the separator, or name every column in the header")
    seen: set[str] = set()
    for name in header:
        if name in seen and name.strip():  # empty names become `Unnamed: N`, which no key names
            raise UserError(f"data file {str(path)!r} names column {name!r} twice in its header (the reader would "
                            "rename the second and read only the first); rename or remove one of them")
        seen.add(name)


def _refuse_compressed_bom(path: Path) -> None:
    """The text reader of `datasets` opens a compressed file without the encoding it is given, so
    a leading BOM stayed the first document's first character (U+FEFF): said, not trained on."""
    with opened(path) as f:
        if f.read(3) == b"\xef\xbb\xbf":
            raise UserError(f"data file {str(path)!r} starts with a byte-order mark, which the reader of compressed "
                            "text would keep as text; re-save it without one (or uncompressed)")


def _not_regular(path: Path) -> bool:
    """A FIFO, device or socket: reading one hangs or never ends."""
    import stat

    return not stat.S_ISREG(path.stat().st_mode) and not path.is_dir()


def _check_entry(path: Path) -> None:
    """One data file as the readers need it: there (a link that leads somewhere), a file (a folder
    named train.jsonl is not one), a regular one (reading a FIFO or device hangs)."""
    if not path.exists():
        raise UserError(f"data file {str(path)!r} is {broken_link(path) or 'gone'}; fix or remove it, or point "
                        "data.path elsewhere")
    if path.is_dir():
        raise UserError(f"data file {str(path)!r} is a folder, not a file; rename or move it out of "
                        f"{str(path.parent)!r}, or point data.path at the files inside it")
    if _not_regular(path):
        raise UserError(f"data file {str(path)!r} is not a regular file (a FIFO, device or socket); point "
                        "data.path at a file or a folder of files")


def _no_rows(path: Path) -> bool:
    """True for a parquet file of no rows (its footer says so; the reader fails on one)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception as exc:  # noqa: BLE001 - pyarrow's ArrowInvalid and friends: not a parquet file
        raise UserError(f"data file {str(path)!r} is not a readable parquet file ({first_line(exc)}); fix or "
                        "re-write it, or point data.path elsewhere") from None


def _refuse_copies(files: list[Path]) -> None:
    """A folder that holds a file beside its compressed copy (`gzip -k train.jsonl`): both were
    read, and every row of it trained twice."""
    seen: dict[str, Path] = {}
    for p in files:
        plain = p.name[:-len(p.suffix)] if kind_of(p).codec else p.name
        if (other := seen.setdefault(plain.lower(), p)) is not p:
            raise UserError(f"data files {other.name!r} and {p.name!r} in {str(p.parent)!r} are one file plain and "
                            "compressed (both would be read: a copy's rows twice); remove one, or rename it")


def data_files(path: Path) -> list[Path]:
    """A local data.path's data files: itself, or a folder's (its hidden files and others not data
    left out), in name order."""
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.iterdir() if (builder_of(p) or unread_data(p)) and not p.name.startswith("."))


def by_split(files: list[Path]) -> dict[str, list[str]]:
    """Data files by split (split_of); all of them are the training split where none is."""
    splits: dict[str, list[str]] = {}
    for p in files:
        splits.setdefault(split_of(p), []).append(str(p))
    return splits if "train" in splits else {"train": [f for group in splits.values() for f in group]}


def local_files(path: Path) -> dict[str, list[str]]:
    """Files of a local dataset, by split, each checked as the readers need it (a pass over every
    text file). A folder's `train*`/`validation*` files are splits."""
    files = data_files(path)
    for p in files:
        _check_entry(p)
    if not files:
        inner = any(builder_of(q) for q in path.glob("*/*"))
        raise UserError(f"data.path={str(path)!r} holds no data files ({supported()})"
                        + ("; its subfolders are not read: point data.path at the subfolder that holds them"
                           if inner else "; point it at a data file or a folder of them"))
    if path.is_dir() and (inner := next((q.parent for q in sorted(path.glob("*/*")) if builder_of(q)
                                         and named_split(q.parent.name) in ("train", "validation")
                                         and q.parent.name[:1] != "."), None)):
        raise UserError(f"data.path={str(path)!r} holds data files, and its subfolder {inner.name!r} holds the "
                        f"{named_split(inner.name)} split's, which would not be read (only the folder's own files "
                        f"are); move them beside the others, named {named_split(inner.name)}*")
    kinds = {p: kind_of(p) for p in files}
    if None in kinds.values() or len({kind.format for kind in kinds.values()}) != 1:
        suffixes = sorted({shown_suffix(p) for p in files})
        raise UserError(f"data.path={str(path)!r} mixes or has unsupported file types ({', '.join(suffixes)}); "
                        f"use one of {supported()}")
    _refuse_copies(files)
    blank = [p for p in files if _is_blank(p) or (kinds[p].format.builder == "parquet" and _no_rows(p))]
    if blank:
        raise UserError(f"data file {str(blank[0])!r} is empty (no documents); add documents to it "
                        "or point data.path elsewhere")
    for p, kind in kinds.items():
        if kind.format.text:
            _check_text_file(p, json_lines=kind.format.builder == "json", boms=kind.format.builder == "text")
        if kind.format.builder == "csv":
            _check_csv_header(p)
        if kind.format.builder == "text" and kind.codec:
            _refuse_compressed_bom(p)
    return by_split(files)


def split_of(path: Path) -> str:
    """The split of a folder's file, by its name (named_split), else train."""
    return named_split(path.stem) or "train"


def named_split(name: str) -> str | None:
    """The split a name says (any case): one it starts with (train*, validation*/valid*/val*/dev*,
    test*), else one whose word it holds as `datasets` names them (its SPLIT_KEYWORDS between
    NON_WORDS_CHARS: alpaca_test, wiki.valid, data-eval-00), else None. Those were all trained
    on: a test or validation file beside a train file read as training data."""
    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    name = name.lower()
    split = next((s for s in ("train", *VAL_NAMES, "test") if name.startswith(s)), None)
    if split is None:
        split = next((str(key) for key, words in SPLIT_KEYWORDS.items()
                      if any(re.search(rf"(^|[{NON_WORDS_CHARS}]){word}([{NON_WORDS_CHARS}]|$)", name)
                             for word in words)), None)
    return "validation" if split in VAL_NAMES else split


def read_path(path: Path, shown: str, say=None, columns: tuple[str, ...] = ()):
    """A local data.path as a DatasetDict: a folder that save_to_disk wrote, as it was saved; else
    its data files (local_files), read by their readers, `columns` (the text a run reads) of one
    kind in every file (kinds.py). `shown`: data.path as the user wrote it.
    `say` gets a line for each file held out of training only because its name starts with a
    split's word (held_out_by_prefix)."""
    if is_saved(path):
        return read_saved(path, shown)
    files = local_files(path)
    held_out = [(split, Path(p).name) for split, paths in files.items() if split != "train" for p in paths
                if held_out_by_prefix(Path(p).stem)]
    for split, name in held_out if say is not None else ():
        words = ", ".join(VAL_NAMES) if split == "validation" else split
        say(f"note: data file {name!r} of {shown} is the {split} split, not training data: its name starts with a "
            f"word of that split's ({words}); rename it to train on it")
    splits = read_local(files, shown)
    check_kinds(files, splits, list(columns))
    return splits


def held_out_by_prefix(name: str) -> bool:
    """Whether the name is a split's only by the README's prefix rule, the split's word running on
    into another (values: val, devices: dev, testimonials: test), which a user may not expect."""
    name = name.lower()
    word = next((s for s in (*VAL_NAMES, "test") if name.startswith(s)), None)  # the longest first
    return word is not None and name[len(word):][:1].isalpha()


def read_local(files: dict[str, list[str]], path: str):
    """Local files (local_files' answer) as a DatasetDict, one split at a time: splits whose
    columns differ are not a load error (a split that lacks a column the format needs is named
    when it is tokenized). A reader's refusal is the file's fault, never the network's."""
    import datasets

    fmt = kind_of(next(iter(files.values()))[0]).format
    out = {}
    for split, names in files.items():
        try:
            out[split] = datasets.load_dataset(fmt.builder, data_files={split: names}, description=_stamp(names),
                                               **reader_options(names[0], fmt))[split]
        except datasets.exceptions.DatasetGenerationError:  # arrow's parse error names no line, nor file
            if fmt.builder == "json" and (line := first_line_not_an_object(names)) is not None:
                raise UserError(line) from None
            line = None  # the reader's refusal names no file (of a folder's, of a split's several)
            if len(names) > 1:
                try:
                    line = columns_that_differ(names, fmt, f"split {split!r} of {path!r}")
                except Exception:  # noqa: BLE001 - a file the reader refuses on its own: found next
                    pass
            if (line := line or file_the_reader_refuses(names, fmt)) is not None:
                raise UserError(line) from None
            raise
        except (FileNotFoundError, ValueError) as exc:
            if "corresponds to no data" in str(exc):  # no row has a field: `{}` lines, a csv header alone
                raise UserError(f"data file(s) {', '.join(repr(n) for n in names)} hold no records with fields "
                                "(empty JSON objects, or a csv header without rows); add documents or point "
                                "data.path elsewhere") from None
            raise UserError(f"could not read data file(s) {', '.join(repr(n) for n in names)} of {path!r} "
                            f"({first_line(exc)}); fix the file or point data.path elsewhere") from None
        if fmt.builder == "json" and (line := columns_in_one_row(out[split], names)):
            raise UserError(line)
    return datasets.DatasetDict(out)


def reader_options(name: str, fmt) -> dict:
    """The `datasets` reader's options for data file `name` (and the files read with it)."""
    return {**fmt.kwargs, **({"features": csv_text_columns(name)} if fmt.builder == "csv" else {})}


def file_the_reader_refuses(names: list[str], fmt) -> str | None:
    """For a reader's refusal of a split (whose message names none of its files): the first file
    that it refuses on its own (streamed), said with the reader's reason as the fix, or None."""
    import datasets

    for name in names:
        try:
            for _ in datasets.load_dataset(fmt.builder, data_files=[name], split="train", streaming=True,
                                           **reader_options(name, fmt)):
                pass
        except Exception as exc:  # noqa: BLE001 - whatever the reader raises, it is about this file
            return f"could not read data file {name!r} ({first_line(exc)}); fix the file or point data.path elsewhere"
    return None


def csv_text_columns(name: str):
    """Every column of a csv file as text, named as pandas names them: a csv cell is the text it
    holds, while pandas took a column of numbers as numbers (02139 became 2139, 3.50 became 3.5,
    1 beside 1.5 became 1.0 in a template's text) and refused a text column of numbers."""
    import datasets
    import pandas

    with opened(name, text=True) as f:
        header = pandas.read_csv(f, nrows=0, sep=kind_of(name).format.kwargs.get("sep", ",")).columns
    return datasets.Features({str(column): datasets.Value("string") for column in header})


def _stamp(names: list[str]) -> str:
    """What tells these files' contents apart, for the readers' cache key (a config's description
    is part of it): `datasets` keys a local file by its path and mtime alone, so a file written
    again with its mtime kept (cp -p, rsync -t, tar, touch -r) was read from the old cache. The
    ctime moves with every write and no tool sets it back; size and inode tell a replaced file."""
    import hashlib

    digest = hashlib.sha256()
    for name in names:
        st = os.stat(name)
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
    return f"shardtune files {digest.hexdigest()[:32]}"


def columns_that_differ(names: list[str], fmt, what: str) -> str | None:
    """For a reader's refusal of a split of several files: the files whose columns are not the
    first file's, said as the fix (the reader casts every file to the first one's columns and says
    only that a cast failed), or None. Each file's first record, streamed, gives its columns."""
    import datasets

    def columns(name: str) -> list[str]:
        stream = datasets.load_dataset(fmt.builder, data_files=[name], split="train", streaming=True,
                                       **reader_options(name, fmt))
        return list(next(iter(stream), {}))

    seen = {name: columns(name) for name in names}
    first = seen[names[0]]
    odd = [name for name in names if set(seen[name]) != set(first)]
    if not odd:
        return None
    shown = "; ".join(f"{Path(n).name} has {', '.join(seen[n]) or 'none'}" for n in [names[0], *odd[:2]])
    return (f"the files of {what} do not share their columns ({shown}); give every file of a split the "
            "same columns, or move the odd ones out of the folder")


def first_line_not_an_object(names: list[str]) -> str | None:
    """For a JSON reader's refusal: the first line of these JSON-lines files that is not one JSON
    object, said as the fix, or None (a .json file that holds one array is read whole)."""
    import json

    for name in names:
        with opened(name, text=True) as f:
            array = kind_of(name).suffix == ".json"  # while no line is read: a .json file may hold one array
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                if array and text.lstrip().startswith("["):
                    break
                array = False
                try:
                    value = json_loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    return (f"line {number} of {name!r} is not JSON ({exc.msg} at character {exc.colno}); a "
                            "JSON-lines file holds one object per line: fix that line")
                if not isinstance(value, dict):
                    return (f"line {number} of {name!r} holds a JSON {type(value).__name__} ({text.strip()[:40]}), "
                            "not an object; a JSON-lines file holds one object {...} per line: fix that line")
    return None
