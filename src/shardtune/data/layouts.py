"""What a local data.path holds, told by its names: each data file's format from its suffixes
(notes.jsonl, notes.tsv, notes.jsonl.gz), or a folder that `save_to_disk` wrote. One table says
which `datasets` reader takes a suffix, and how; a compressed text file is read decompressed
through fsspec, by that reader and by files.py's checks alike (a stream, never the whole file)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from shardtune.errors import UserError, first_line
from shardtune.fsio import json_loads


@dataclass(frozen=True)
class Format:
    builder: str  # the `datasets` reader
    options: tuple[tuple[str, str], ...] = ()  # its settings: a tsv is a csv with sep="\t"
    text: bool = True  # UTF-8 lines: checked line by line, and may be compressed

    @property
    def kwargs(self) -> dict:
        return dict(self.options)


# a csv cell is null only where it is empty: pandas' default also reads the text NA, None, null,
# nan, N/A, #N/A, ... as null, and such a document was dropped as "null or empty"
CSV_CELLS = (("keep_default_na", False), ("na_values", ("",)))
TEXT = (("encoding", "utf-8-sig"),)  # a leading BOM (Windows editors write one) is no text of the first line
FORMATS = {".txt": Format("text", TEXT), ".text": Format("text", TEXT),
           ".jsonl": Format("json"), ".json": Format("json"),
           ".csv": Format("csv", CSV_CELLS), ".tsv": Format("csv", (("sep", "\t"), *CSV_CELLS)),
           ".parquet": Format("parquet", text=False), ".arrow": Format("arrow", text=False)}
# a text file's compression suffix: (fsspec's codec, the package it needs where Python has none)
COMPRESSIONS = {".gz": ("gzip", None), ".bz2": ("bz2", None), ".xz": ("xz", None), ".zst": ("zstd", "zstandard")}


@dataclass(frozen=True)
class Kind:
    """A data file's kind: `suffix` is its format's (.json for notes.json.gz), `codec` fsspec's
    name of its compression (None: not compressed)."""

    suffix: str
    format: Format
    codec: str | None = None
    package: str | None = None


def kind_of(path) -> Kind | None:
    """A data file's kind by its suffixes, in any case (TRAIN.JSONL.GZ); None for no data file."""
    suffixes = [s.lower() for s in Path(path).suffixes[-2:]]
    codec = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if codec:
        suffixes.pop()
    fmt = FORMATS.get(suffixes[-1]) if suffixes else None
    if fmt is None or (codec and not fmt.text):
        return None
    return Kind(suffixes[-1], fmt, *(codec or ()))


# compressions and archives no reader here takes: a data file in one is refused, not passed over
OTHER_CODECS = {".zip", ".lz4", ".lzma", ".7z", ".rar", ".tar", ".tgz", ".br", ".zstd", ".z", ".snappy"}


def unread_data(path) -> bool:
    """A data file compressed as no reader takes it (train.jsonl.zip, notes.parquet.gz): a folder's
    such file was passed over like a README, and a validation file so named was not used."""
    suffixes = [s.lower() for s in Path(path).suffixes[-2:]]
    return (kind_of(path) is None and len(suffixes) == 2 and suffixes[0] in FORMATS
            and (suffixes[1] in COMPRESSIONS or suffixes[1] in OTHER_CODECS))


def builder_of(path) -> str | None:
    """The `datasets` reader of a data file, by its suffixes."""
    kind = kind_of(path)
    return kind.format.builder if kind else None


def shown_suffix(path) -> str:
    """The suffix a refusal names: .gz of notes.gz, .parquet.gz of notes.parquet.gz."""
    suffixes = Path(path).suffixes[-2:]
    return "".join(suffixes if suffixes and suffixes[-1].lower() in {*COMPRESSIONS, *OTHER_CODECS} else suffixes[-1:])


def supported() -> str:
    """The data.path a reader takes, said as the fix."""
    text = "/".join(sorted(s for s, f in FORMATS.items() if f.text))
    return (f"{', '.join(sorted(FORMATS))} files ({text} also as {'/'.join(COMPRESSIONS)}), or a folder written by "
            "save_to_disk")


@contextlib.contextmanager
def opened(path, text: bool = False):
    """A data file's bytes (`text`: its UTF-8 text, line ends untouched, as csv reads them),
    decompressed as its suffix says. A compressed stream that is corrupt or cut short is the
    file's fault, and so is a codec that is not installed: one line each."""
    import fsspec
    from fsspec.compression import available_compressions

    kind = kind_of(path)
    codec = kind.codec if kind else None
    if codec and codec not in available_compressions():
        raise UserError(f"data file {str(path)!r} is {codec}-compressed, and reading it needs the {kind.package} "
                        f"package: pip install {kind.package}")
    encoding = {"encoding": "utf-8-sig", "newline": ""} if text else {}  # a BOM is no text, as to the readers
    with fsspec.open(os.fspath(path), "rt" if text else "rb", compression=codec, **encoding) as f:
        try:
            yield f
        except (UserError, UnicodeError):
            raise
        except Exception as exc:  # each codec has its own: EOFError, BadGzipFile, OSError, LZMAError, ZstdError
            if codec is None:
                raise
            raise UserError(f"data file {str(path)!r} is not a readable {codec} file ({first_line(exc)}); compress "
                            "it again, or point data.path elsewhere") from None


def is_saved(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (its dataset_info.json and state.json) or by
    `DatasetDict.save_to_disk` (dataset_dict.json beside a folder a split)."""
    from datasets import config

    return path.is_dir() and ((path / config.DATASETDICT_JSON_FILENAME).is_file()
                              or all((path / name).is_file() for name in (config.DATASET_INFO_FILENAME,
                                                                         config.DATASET_STATE_JSON_FILENAME)))


def read_saved(path: Path, shown: str):
    """A saved folder as a DatasetDict (a single Dataset is the train split), read by
    `datasets.load_from_disk`: memory-mapped where it lies, as the readers' cache is. Without the
    format it was saved with (`set_format("numpy")`, "pandas", "arrow", a subset of columns): the
    formats read rows as Python values, and a numpy list cell became the text "['e4' 'e5']", chat
    messages were refused as not a list and instruct rows crashed on arrow's."""
    import datasets

    _refuse_empty_saved(path, shown)
    try:
        loaded = datasets.load_from_disk(os.fspath(path))
    except (OSError, ValueError, KeyError) as exc:  # a file it lists is gone, a JSON file is not JSON
        raise UserError(f"could not read the dataset that save_to_disk wrote in {shown!r} ({first_line(exc)}); "
                        "save it again, or point data.path elsewhere") from None
    for split in loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]:
        if split.format["type"] is not None or split.format["columns"] != split.column_names:
            split.reset_format()  # only where set: a reset is a new fingerprint, which the token caches key on
    return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})


def _refuse_empty_saved(path: Path, shown: str) -> None:
    """A saved split of no rows: save_to_disk writes it without an arrow file, and load_from_disk
    then fails on it with an IndexError. Its state.json lists its files (an unreadable one is left
    to load_from_disk, whose refusal names it)."""
    from datasets import config

    name = config.DATASET_STATE_JSON_FILENAME
    for state in sorted([path / name, *path.glob(f"*/{name}")]):
        try:
            files = json_loads(state.read_text(encoding="utf-8")).get("_data_files")
        except (OSError, ValueError, AttributeError):
            continue
        if files == []:
            what = "the dataset" if state.parent == path else f"split {state.parent.name!r} of the dataset"
            raise UserError(f"{what} that save_to_disk wrote in {shown!r} has no rows (load_from_disk cannot read "
                            "it); add rows or leave that split out when saving, or point data.path elsewhere")
