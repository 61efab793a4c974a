"""data/layouts.py: the same rows in every layout data.path takes (each format, compressed or not,
a folder save_to_disk wrote) are the same documents, token for token; the layouts it does not
take, and compressed files it cannot read, are one line."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import re
from pathlib import Path

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import pipeline as D
from shardtune.errors import UserError

# commas, quotes and non-ASCII: what a reader that splits or decodes wrongly gets wrong
ROWS = {"train": [{"text": f'doc {i}: "naïve", café, 東京; {"a b " * (i % 4)}end', "id": i} for i in range(12)],
        "validation": [{"text": f"held out {i}, ünïcode and more words", "id": i} for i in range(4)]}


def _zstd(path: Path, mode: str):
    import fsspec
    from fsspec.compression import available_compressions

    if "zstd" not in available_compressions():
        pytest.skip("no zstd codec here (pip install zstandard)")
    return fsspec.open(str(path), mode, compression="zstd")


CODECS = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open, "zst": _zstd}


def _text(fmt: str, rows: list[dict]) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if fmt == "json":
        return json.dumps(rows, ensure_ascii=False)
    if fmt == "txt":
        return "".join(r["text"] + "\n" for r in rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, ["text", "id"], delimiter="\t" if fmt == "tsv" else ",")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_file(path: Path, rows: list[dict]) -> None:
    """`rows` as the file `path` names: its format's suffix, then perhaps a compression's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fmt, _, codec = path.name.lower().split(".", 1)[1].partition(".")
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "arrow":
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        data = _text(fmt, rows).encode()
        with (CODECS[codec](path, "wb") if codec else open(path, "wb")) as f:
            f.write(data)


def saved(path: Path, splits) -> None:
    import datasets

    made = {split: datasets.Dataset.from_list(ROWS[split]) for split in splits}
    (datasets.DatasetDict(made) if len(splits) > 1 else made["train"]).save_to_disk(str(path))


def folder(tmp: Path, suffix: str) -> Path:
    for split, rows in ROWS.items():
        write_file(tmp / f"{split}.{suffix}", rows)
    return tmp


def one_file(tmp: Path) -> Path:
    write_file(tmp / "Notes.JSONL.GZ", ROWS["train"])
    return tmp / "Notes.JSONL.GZ"


def saved(tmp: Path, splits: list[str]) -> Path:
    import datasets

    made = {split: datasets.Dataset.from_list(ROWS[split]) for split in splits}
    (datasets.DatasetDict(made) if len(splits) > 1 else made["train"]).save_to_disk(str(tmp / "saved"))
    return tmp / "saved"


FILES = ["jsonl", "json", "csv", "tsv", "txt", "parquet", "arrow", "jsonl.gz", "json.gz", "csv.gz", "tsv.gz", "txt.gz",
         "jsonl.bz2", "jsonl.xz", "jsonl.zst"]
# layout -> (writes it under a folder and returns data.path, the splits it holds)
LAYOUTS = {**{f"folder-of-{suffix}": (lambda tmp, s=suffix: folder(tmp, s), ["train", "validation"])
              for suffix in FILES},
           "one-jsonl.gz-file": (one_file, ["train"]),
           "saved-Dataset": (lambda tmp: saved(tmp, ["train"]), ["train"]),
           "saved-DatasetDict": (lambda tmp: saved(tmp, ["train", "validation"]), ["train", "validation"])}


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["tokenizer"])


def token_ids(docs, cfg: DataConfig, tokenizer) -> list[list[int]]:
    return D.tokenize_split(docs, cfg, tokenizer, "docs")[:]["input_ids"].tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_same_token_ids(tmp_path, tokenizer, layout):
    import datasets

    make, split_names = LAYOUTS[layout]
    cfg = DataConfig(path=str(make(tmp_path)), seq_len=8)
    splits = D.load_documents(cfg)
    assert sorted(splits) == split_names, layout  # validation.jsonl.gz is the validation split
    for split in split_names:
        expected = token_ids(datasets.Dataset.from_list(ROWS[split]), cfg, tokenizer)
        assert token_ids(splits[split], cfg, tokenizer) == expected, (layout, split)


def truncated_gz(path: Path) -> None:
    whole = gzip.compress(_text("jsonl", ROWS["train"] * 20).encode())
    path.write_bytes(whole[:len(whole) // 2])


@pytest.mark.parametrize(("name", "write", "words"), [
    ("train.jsonl.gz", truncated_gz, ["train.jsonl.gz' is not a readable gzip file", "compress it again"]),
    ("train.txt.gz", lambda p: p.write_text("plain text, not gzip\n"), ["not a readable gzip file", "Not a gzip"]),
    ("train.jsonl.xz", lambda p: p.write_bytes(lzma.compress(b'{"text": "x"}\n' * 50)[:-20]), ["readable xz file"]),
    ("notes.xml", lambda p: p.write_text("<a/>"), ["unsupported file types (.xml)", ".arrow", ".tsv", ".gz", ".zst",
                                                   "save_to_disk"]),
    ("notes.parquet.gz", lambda p: p.write_bytes(gzip.compress(b"PAR1")), ["unsupported file types (.parquet.gz)"]),
])
def test_unreadable_compressed_and_unsupported_files_are_one_line(tmp_path, name, write, words):
    write(tmp_path / name)
    with pytest.raises(UserError) as caught:
        D.load_documents(DataConfig(path=str(tmp_path / name)))
    line = str(caught.value)
    assert "\n" not in line and all(word in line for word in words), line


def test_a_zstd_file_without_a_codec_says_what_to_install(tmp_path, monkeypatch):
    import fsspec.compression

    (tmp_path / "train.jsonl.zst").write_bytes(b"(\xb5/\xfd not really")
    monkeypatch.setattr(fsspec.compression, "available_compressions", lambda: ["gzip", "bz2", "xz"])
    with pytest.raises(UserError, match=r"^data file '.*train.jsonl.zst' is zstd-compressed.*pip install zstandard$"):
        D.load_documents(DataConfig(path=str(tmp_path)))


def test_a_broken_saved_folder_is_one_line(tmp_path):
    saved(tmp_path, ["train", "validation"])
    for arrow in (tmp_path / "saved" / "validation").glob("*.arrow"):
        arrow.unlink()
    with pytest.raises(UserError, match=r"^could not read the dataset that save_to_disk wrote in .*save it again"):
        D.load_documents(DataConfig(path=str(tmp_path / "saved")))


def test_a_missing_compressed_file_is_not_looked_for_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"data file 'corpus.jsonl.gz' not found; check data.path"):
        D.load_documents(DataConfig(path="corpus.jsonl.gz"))


@pytest.mark.parametrize(("other", "shown"), [("validation.jsonl.zip", ".jsonl.zip"),
                                              ("validation.parquet.gz", ".parquet.gz"), ("more.csv.lz4", ".csv.lz4")])
def test_a_folders_data_file_in_a_compression_no_reader_takes_is_refused(tmp_path, other, shown):
    """validation.jsonl.zip beside train.jsonl was passed over like a README: the run carved its
    validation out of the training file instead, without a word. Other files stay unread."""
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    for name in ("README.md", "notes.tar.gz", "train.jsonl.bak"):
        (tmp_path / name).write_text("not data\n")
    assert D.load_documents(DataConfig(path=str(tmp_path)))["train"]["text"] == ["a"]
    (tmp_path / other).write_bytes(b"PK")
    with pytest.raises(UserError, match=rf"mixes or has unsupported file types \(.*{re.escape(shown)}"):
        D.load_documents(DataConfig(path=str(tmp_path)))


SHAPES = {  # data.format and its keys -> a row of that shape (a list cell, a number, chat messages)
    "text": ({"template": "Game {id}: {moves} ({meta[white]})"},
             {"id": 3, "moves": ["e4", "e5"], "meta": {"white": "A"}}),
    "instruct": ({"template": "{instruction} {moves}: "}, {"instruction": "play", "moves": ["d4"], "output": "d5 c4"}),
    "chat": ({"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                               "{% endfor %}"},
             {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}),
}


@pytest.mark.parametrize("fmt", SHAPES)
def test_a_folder_saved_with_a_format_reads_as_saved_without_one(tmp_path, fmt):
    """load_from_disk brings back the format a dataset was saved with, and the formats read rows as Python
    values: under set_format("numpy") or "pandas" a list cell rendered as the text "['e4' 'e5']", chat
    messages were refused as no list, and instruct rows crashed under "arrow". Every saved format now
    gives the token ids of the same rows saved plain."""
    import datasets

    from conftest import llama_tokenizer

    keys, row = SHAPES[fmt]
    ids = {}
    for kind in (None, "numpy", "pandas", "arrow", "torch", "columns"):
        ds = datasets.Dataset.from_list([row] * 3)
        ds.set_format(**({"columns": ds.column_names[:1]} if kind == "columns" else {"type": kind}))
        ds.save_to_disk(str(tmp_path / str(kind)))
        cfg = DataConfig(path=str(tmp_path / str(kind)), seq_len=4 if fmt == "text" else 128, val_size=0,
                         format=fmt, **keys)
        train, _ = D.prepare(cfg, llama_tokenizer())
        ids[kind] = [train[i]["input_ids"].tolist() for i in range(len(train))]
    assert ids["numpy"] == ids[None] and all(v == ids[None] for v in ids.values()), ids
