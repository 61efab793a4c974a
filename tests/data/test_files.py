"""data/files.py: a local dataset's files checked before a reader takes them."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import lzma
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.data.files import local_files, read_local, read_path
from shardtune.errors import UserError

NAMES = st.text(alphabet="ab ,\"\n.1", min_size=1, max_size=4).filter(lambda name: name.strip())


@settings(max_examples=60, deadline=None)
@given(header=st.lists(NAMES, min_size=1, max_size=5), in_validation=st.booleans())
def test_a_csv_header_naming_a_column_twice_is_refused(header, in_validation):
    """pandas (the csv reader of `datasets`) renames a repeated column (`text` -> `text.1`), so a
    run read the first one silently: refused, naming the file and the column, exactly when the
    reader would rename one (whatever the quoting, commas or line breaks inside the names)."""
    import pandas

    with tempfile.TemporaryDirectory() as folder:
        check_header(Path(folder), header, in_validation, pandas)


def check_header(tmp_path: Path, header: list[str], in_validation: bool, pandas) -> None:
    text = io.StringIO()
    csv.writer(text).writerows([header, ["x"] * len(header)])
    good, bad = tmp_path / "train.csv", tmp_path / "validation.csv"
    good.write_text("text\nsome words\n")
    (bad if in_validation else good).write_text(text.getvalue())
    renamed = list(pandas.read_csv(io.StringIO(text.getvalue()), nrows=0).columns) != header
    try:
        local_files(tmp_path)
    except UserError as exc:
        line = str(exc)
        assert renamed and "\n" not in line and str(bad if in_validation else good) in line, line
        assert any(f"column {name!r} twice" in line for name in header if header.count(name) > 1), line
        return
    assert not renamed


def test_a_csv_header_with_unnamed_columns_is_read(tmp_path):
    """Empty header cells are the reader's `Unnamed: N`, which no key names: not a repeated column."""
    (tmp_path / "train.csv").write_text(",text,\n1,some words,2\n")
    assert local_files(tmp_path) == {"train": [str(tmp_path / "train.csv")]}


@pytest.mark.parametrize("content", ["text,text\na,b\n", "\"text\",text\na,b\n", "a,text,a\n1,b,2\n",
                                     "\ufefftext,text\na,b\n"])  # a BOM is not part of the first name
def test_repeated_csv_columns_name_the_file(tmp_path, content):
    (tmp_path / "notes.csv").write_text(content)
    with pytest.raises(UserError, match=r"notes.csv' names column '(text|a)' twice"):
        local_files(tmp_path / "notes.csv")


@settings(max_examples=60, deadline=None)
@given(header=st.lists(st.sampled_from(["text", "a", "b", "c"]), min_size=1, max_size=3, unique=True),
       widths=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_a_csv_row_wider_than_its_header_is_refused_where_the_reader_would_shift_columns(header, widths):
    """pandas takes a first row's extra leading fields as an index and reads the rest under the
    header's names, one column off (a later wider row it refuses itself): a first row wider than the
    header is refused, naming the file, and nothing else shifts a column."""
    import pandas

    text = io.StringIO()
    csv.writer(text).writerows([header, *[[f"v{row}{i}" for i in range(width)] for row, width in enumerate(widths)]])
    try:
        shifted = not isinstance(pandas.read_csv(io.StringIO(text.getvalue())).index, pandas.RangeIndex)
    except pandas.errors.ParserError:  # a row wider than the first: the reader refuses the file
        shifted = None
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "train.csv").write_text(text.getvalue())
        try:
            local_files(Path(folder))
        except UserError as exc:
            assert widths[0] > len(header) and shifted is not False, str(exc)
            assert "train.csv" in str(exc) and "header names" in str(exc) and "\n" not in str(exc), str(exc)
            return
    assert widths[0] <= len(header) and not shifted


COMPRESS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}


def compressed(path: Path, content: bytes) -> Path:
    path.write_bytes(COMPRESS[path.suffix[1:]](content))
    return path


@pytest.mark.parametrize(("name", "content", "words"), [
    ("train.jsonl.gz", b"\n  \n", ["train.jsonl.gz' is empty"]),
    ("train.txt.bz2", "fine\ncaf\xe9\n".encode("latin-1"), ["train.txt.bz2' is not UTF-8 text (line 2"]),
    ("train.jsonl.xz", b'{"text": "a"}\nnull\n', ["train.jsonl.xz' line 2 is `null`"]),
    ("train.csv.gz", b"text,text\na,b\n", ["train.csv.gz' names column 'text' twice"]),
    ("train.tsv.gz", b"id\ttext\ttext\n1\ta\tb\n", ["train.tsv.gz' names column 'text' twice"]),
])
def test_the_checks_read_a_compressed_file_decompressed(tmp_path, name, content, words):
    """Each check before the readers sees what they will: the decompressed text, not its bytes."""
    compressed(tmp_path / name, content)
    with pytest.raises(UserError) as caught:
        local_files(tmp_path)
    assert "\n" not in str(caught.value) and all(word in str(caught.value) for word in words), str(caught.value)


def test_a_tsv_header_is_split_at_tabs(tmp_path):
    """`a,a` is one column of a tsv, not `a` twice."""
    compressed(tmp_path / "train.tsv.gz", b"a,a\ttext\n1\tsome words\n")
    assert local_files(tmp_path) == {"train": [str(tmp_path / "train.tsv.gz")]}


def test_a_line_that_is_not_an_object_is_named_in_a_compressed_file(tmp_path):
    compressed(tmp_path / "train.jsonl.gz", b'{"text": "a"}\n\n[1, 2]\n')
    with pytest.raises(UserError, match=r"^line 3 of '.*train.jsonl.gz' holds a JSON list"):
        read_local(local_files(tmp_path), str(tmp_path))


def test_compressed_files_are_splits_by_name_and_csv_is_not_tsv(tmp_path):
    compressed(tmp_path / "Train.jsonl.gz", b'{"text": "a"}\n')
    compressed(tmp_path / "validation.jsonl.bz2", b'{"text": "b"}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "c"}\n')
    assert local_files(tmp_path) == {"train": [str(tmp_path / "Train.jsonl.gz")],
                                     "validation": [str(tmp_path / "validation.jsonl.bz2")],
                                     "test": [str(tmp_path / "test.jsonl")]}
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.csv").write_text("text\na\n")
    compressed(other / "validation.tsv.gz", b"text\nb\n")
    with pytest.raises(UserError, match=r"mixes or has unsupported file types \(.csv, .tsv.gz\)"):
        local_files(other)


def write_texts(path: Path, texts: list[str], bom: bool = False) -> Path:
    """`texts` as the one column `text` of a data file of path's format (written as a user would)."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path)
        return path
    if path.suffix in (".csv", ".tsv"):
        out = io.StringIO()
        csv.writer(out, delimiter="\t" if path.suffix == ".tsv" else ",").writerows([["text"], *[[t] for t in texts]])
        content = out.getvalue()
    else:
        import json

        content = "".join((t if path.suffix == ".txt" else json.dumps({"text": t})) + "\n" for t in texts)
    path.write_bytes(b"\xef\xbb\xbf" * bom + content.encode())
    return path


@pytest.mark.parametrize("name", ["train.jsonl", "train.csv", "train.txt", "train.parquet"])
def test_a_file_written_again_with_its_mtime_kept_is_read_again(tmp_path, name):
    """`datasets` keys its cache of a local file by path and mtime alone: a file written again and
    given its old mtime back (cp -p, rsync -t, tar, touch -r) was read from the cache of its old
    contents, and the run trained on them."""
    import os

    path = write_texts(tmp_path / name, ["old words", "old rows"])
    before = os.stat(path)
    assert read_local(local_files(tmp_path), str(tmp_path))["train"]["text"] == ["old words", "old rows"]
    write_texts(path, ["new words", "new rows"])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert read_local(local_files(tmp_path), str(tmp_path))["train"]["text"] == ["new words", "new rows"]


# pandas' default null markers: its csv reader read every one of these texts as a null cell
NULL_LIKE = ["#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
             "NA", "NULL", "NaN", "None", "n/a", "nan", "null"]


@pytest.mark.parametrize("name", ["train.csv", "train.tsv.gz"])
def test_csv_cells_are_the_text_they_hold(tmp_path, name):
    """A csv cell `NA`, `None`, `null`, `nan`, ... is that text (a name, a word, an answer), not a
    null: it was dropped as 'null or empty'. A column of numbers is their text: 02139 was 2139 and
    3.50 was 3.5 in a template's text, and a text column of numbers was refused. Only an empty
    cell is null."""
    texts = [*NULL_LIKE, "", "plain"]
    numbers = [f"{i:05d}" if i % 3 else f"{i}.50" for i in range(len(texts))]
    numbers[1] = ""
    out = io.StringIO()
    rows = [["text", "n"], *zip(texts, numbers, strict=True)]
    csv.writer(out, delimiter="\t" if ".tsv" in name else ",").writerows(rows)
    if name.endswith(".gz"):
        compressed(tmp_path / name, out.getvalue().encode())
    else:
        (tmp_path / name).write_text(out.getvalue())
    read = read_local(local_files(tmp_path), str(tmp_path))["train"]
    assert read["text"] == [t or None for t in texts] and read["n"] == [n or None for n in numbers]


@pytest.mark.parametrize("name", ["train.txt", "train.jsonl", "train.csv", "train.jsonl.gz", "train.csv.bz2",
                                  "train.txt.gz"])
def test_a_byte_order_mark_is_no_text(tmp_path, name):
    """Windows editors start a UTF-8 file with a BOM: the text reader kept it as the first
    document's first character (U+FEFF, tokens the user never wrote). Compressed, that reader
    takes no encoding: refused there."""
    path = write_texts(tmp_path / name.removesuffix(".gz").removesuffix(".bz2"), ["first line", "second"], bom=True)
    if path.name != name:
        (tmp_path / name).write_bytes(COMPRESS[name.rsplit(".", 1)[1]](path.read_bytes()))
        path.unlink()
    if name == "train.txt.gz":
        with pytest.raises(UserError, match=r"train.txt.gz' starts with a byte-order mark"):
            local_files(tmp_path)
        return
    assert read_local(local_files(tmp_path), str(tmp_path))["train"]["text"] == ["first line", "second"]


@pytest.mark.parametrize(("names", "splits"), [
    (["alpaca_train.jsonl", "alpaca_test.jsonl"], {"train": ["alpaca_train.jsonl"], "test": ["alpaca_test.jsonl"]}),
    (["wiki.train.jsonl", "wiki.valid.jsonl"], {"train": ["wiki.train.jsonl"], "validation": ["wiki.valid.jsonl"]}),
    (["data-00.jsonl", "data-eval-00.jsonl", "notes_dev.jsonl"],
     {"train": ["data-00.jsonl"], "test": ["data-eval-00.jsonl"], "validation": ["notes_dev.jsonl"]}),
    (["contest.jsonl", "Train.jsonl", "validation_2.jsonl"],
     {"train": ["Train.jsonl", "contest.jsonl"], "validation": ["validation_2.jsonl"]}),
    (["my_test.jsonl", "notes.jsonl"], {"train": ["notes.jsonl"], "test": ["my_test.jsonl"]}),
    (["my_test.jsonl", "my_dev.jsonl"], {"train": ["my_dev.jsonl", "my_test.jsonl"]}),
])
def test_a_split_named_as_a_word_of_a_file_name_is_that_split(tmp_path, names, splits):
    """A folder's files whose names hold a split's word after a separator (as `datasets` names
    splits) are that split: alpaca_test.jsonl beside alpaca_train.jsonl was read as training data,
    the test set trained on. A word inside another word (contest) is no split; without a training
    file every file is one."""
    for name in names:
        (tmp_path / name).write_text('{"text": "a"}\n')
    assert local_files(tmp_path) == {split: [str(tmp_path / n) for n in files] for split, files in splits.items()}


def test_a_file_held_out_only_by_the_prefix_rule_is_said(tmp_path):
    """values.jsonl (val*) beside train.jsonl is held out by name, a rule the user may not know: a
    line names it; plainly named splits (validation.jsonl, dev-2.jsonl, test.jsonl) say nothing."""
    for name in ("train.jsonl", "values.jsonl", "validation.jsonl", "dev-2.jsonl", "testimonials.jsonl"):
        (tmp_path / name).write_text('{"text": "a"}\n')
    said = []
    assert sorted(read_path(tmp_path, "data/", say=said.append)) == ["test", "train", "validation"]
    assert [line.split("'")[1] for line in said] == ["values.jsonl", "testimonials.jsonl"], said
    assert "is the validation split, not training data" in said[0] and "rename it" in said[0]


@pytest.mark.parametrize("names", [["train.jsonl", "train.jsonl.gz"],
                                   ["Validation.jsonl.xz", "train.jsonl", "validation.jsonl"]])
def test_a_file_beside_its_compressed_copy_is_refused(tmp_path, names):
    """`gzip -k train.jsonl` leaves both: each was a training file, and every row trained twice."""
    for name in names:
        (tmp_path / name).write_bytes(COMPRESS.get(name.rsplit(".", 1)[1], bytes)(b'{"text": "a"}\n'))
    with pytest.raises(UserError, match=r"are one file plain and compressed \(both would be read"):
        local_files(tmp_path)


@pytest.mark.parametrize(("files", "bad", "words"), [
    ({"train.csv": "text\na\nb\nc,d\n", "validation.csv": "text\nv\n"}, "train.csv", "line 4"),
    ({"train-1.csv": "text\na\n", "train-2.csv": 'text\n"open quote\nb\n'}, "train-2.csv", "EOF inside string"),
    ({"train-1.jsonl": '{"text": "a"}\n', "train-2.jsonl": '{"text": "a", "text": "b"}\n'}, "train-2.jsonl", "twice"),
])
def test_a_file_the_reader_refuses_is_named(tmp_path, files, bad, words):
    """The reader's refusal of a folder's file named the folder (or, for a broken file among a
    split's several, told to download the dataset): the refusal names the file and the reader's
    reason, with its line."""
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    with pytest.raises(UserError) as caught:
        read_local(local_files(tmp_path), str(tmp_path))
    line = str(caught.value)
    assert f"could not read data file {str(tmp_path / bad)!r}" in line and words in line and "\n" not in line, line


CELLS = st.lists(st.sampled_from([*"ab ,;\"'\t\r\n\\{}[]#0.5é\u0301\u200fא😀\x00\x0b\x85\u2028", *NULL_LIKE, "1", "007",
                                  "3.50", "True", "\ufeff"]), max_size=6).map("".join).filter(str.strip)


@settings(max_examples=15, deadline=None)  # each a reader run, ~0.2 s
@given(texts=st.lists(CELLS, min_size=1, max_size=5), name=st.sampled_from(
    ["train.jsonl", "train.json", "train.csv", "train.tsv", "train.parquet", "train.txt", "train.jsonl.gz"]))
def test_every_format_reads_the_rows_a_plain_reader_reads(texts, name):
    """The rows the readers give, in order, are those of json/csv/pyarrow reading the file
    (a .txt file's lines as Python reads them): no row dropped, added or changed."""
    import json

    import pyarrow.parquet as pq

    if name.endswith(".txt"):
        texts = [t.replace("\r", " ").replace("\n", " ") for t in texts]  # a line of a .txt file
        # a later line that starts with a byte-order mark is refused (test_the_text_check_finds_...)
        texts = texts[:1] + ["x" + t if t.startswith("\ufeff") else t for t in texts[1:]]
    with tempfile.TemporaryDirectory() as folder:
        path = write_texts(Path(folder) / name.removesuffix(".gz"), texts)
        if name == "train.json":
            path.write_text(json.dumps([{"text": t} for t in texts]))
        if name.endswith(".gz"):
            path = compressed(path.with_name(name), path.read_bytes())
            (Path(folder) / name.removesuffix(".gz")).unlink()
        if path.suffix in (".csv", ".tsv"):
            with open(path, newline="", encoding="utf-8") as f:
                wanted = [row[0] for row in list(csv.reader(f, delimiter="\t" if path.suffix == ".tsv" else ","))[1:]]
        elif path.suffix == ".parquet":
            wanted = pq.read_table(path).column("text").to_pylist()
        elif path.suffix == ".txt":
            wanted = path.read_text(encoding="utf-8-sig").split("\n")[:-1]  # a leading BOM is no text
        else:
            wanted = texts
        assert list(read_local(local_files(Path(folder)), folder)["train"]["text"]) == wanted


PIECES = [b"a", b" ", b"\r", b"\n", b"null", b'{"t": 1}', "é".encode(), "😀".encode(), b"\xe9", b"\xf0\x9f",
          b"\xef\xbb\xbf"]


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=30), chunk=st.integers(1, 9), json_lines=st.booleans(),
       boms=st.booleans())
def test_the_text_check_finds_what_a_whole_file_read_finds(pieces, chunk, json_lines, boms):
    """The check reads a chunk at a time (a character or a line may straddle chunks) and carries
    only a short line start (a file of one long line was copied again with every chunk: quadratic):
    it refuses exactly the files that a whole read finds not UTF-8, with a bare `null` line or (a
    .txt) a byte-order mark starting a line but the first (`cat` of files a Windows editor saved: it
    stayed the first character of a document), at the first such line and byte."""
    from unittest import mock

    from shardtune.data import files

    content = b"".join(pieces)
    found = []
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = content.count(b"\n", 0, exc.start) + 1
        found.append(f"is not UTF-8 text (line {line}, byte {exc.start})")
    if json_lines:
        nulls = [i for i, text in enumerate(content.split(b"\n"), 1) if text.strip(b" \t\r") == b"null"]
        found += [f"line {i} is `null`" for i in nulls[:1]]
    if boms and (bom := re.search(b"[\r\n]\xef\xbb\xbf", content)):
        line = content.count(b"\n", 0, bom.start() + 1) + 1
        found.append(f"line {line} starts with a byte-order mark")
    with tempfile.TemporaryDirectory() as folder, mock.patch.object(files, "CHECK_CHUNK", chunk):
        path = Path(folder) / "train.jsonl"
        path.write_bytes(content)
        try:
            files._check_text_file(path, json_lines, boms)
        except UserError as exc:
            assert any(f"{str(path)!r} {what}" in str(exc) for what in found), (str(exc), found)
            return
    assert not found


@pytest.mark.parametrize(("inner", "refused"), [("validation/part-0.jsonl", True), ("train_more/b.jsonl", True),
                                                ("old/train.jsonl", False), ("test/x.jsonl", False),
                                                (".cache/validation.jsonl", False), ("validation/README.md", False)])
def test_a_split_subfolder_beside_data_files_is_refused(tmp_path, inner, refused):
    """Only a folder's own files are read: validation/ beside train.jsonl was passed over, and the
    run carved its validation out of the training file instead."""
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / inner).parent.mkdir()
    (tmp_path / inner).write_text('{"text": "b"}\n')
    if not refused:
        assert local_files(tmp_path) == {"train": [str(tmp_path / "train.jsonl")]}
        return
    with pytest.raises(UserError, match=rf"its subfolder '{inner.split('/')[0]}' holds the \w+ split's, which would "
                                        "not be read"):
        local_files(tmp_path)


@pytest.mark.parametrize(("name", "content"), [("notes.csv", "text,n\n{big},1\nsmall,2\n"),
                                               ("notes.tsv", "text\tn\n\"{big}\"\t1\nsmall\t2\n"),
                                               ("notes.csv", "text,{big}\nsmall,2\n")])
def test_a_csv_field_longer_than_the_csv_modules_limit_is_read(tmp_path, name, content):
    """The header check read the first records with the csv module, whose fields stop at 128 KiB: a
    first document of ~25k words (an article, a chapter) failed with a traceback (pandas reads it)."""
    import csv

    big = "word, " * 30_000 if name.endswith(".tsv") else "word " * 30_000
    (tmp_path / name).write_text(content.format(big=big.strip()))
    rows = read_path(tmp_path / name, name)["train"].to_list()
    assert [len(r["text"]) for r in rows][-1] == 5 and csv.field_size_limit() == 128 * 1024
    assert content.startswith("text,{big}") or rows[0]["text"] == big.strip()
