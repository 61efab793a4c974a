"""data/files.py: a local dataset's files checked before a reader takes them."""

from __future__ import annotations

import csv
import io
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.data.files import local_files
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


@pytest.mark.parametrize("content", ["text,text\na,b\n", "\"text\",text\na,b\n", "a,text,a\n1,b,2\n"])
def test_repeated_csv_columns_name_the_file(tmp_path, content):
    (tmp_path / "notes.csv").write_text(content)
    with pytest.raises(UserError, match=r"notes.csv' names column '(text|a)' twice"):
        local_files(tmp_path / "notes.csv")
