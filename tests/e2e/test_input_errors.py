"""Bad data files, with test_errors.py's harness: files and folders, formats, columns (model
inputs: test_model_inputs.py). Each is one `error: ...` line naming the problem and the fix, exit code 2,
no traceback, nothing already written destroyed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_errors import (  # noqa: F401 - fixtures used by name (and the autouse isolation)
    TINY_GPT2,
    _isolated,
    datasets_cache,
    fails,
    out,
    qs_assets,
    recipe,
    snapshot,
    write_jsonl,
)
from test_outputs import earlier_run, tree  # noqa: F401 - a finished run with checkpoints

# ----------------------------------------------------------------------------- data


def test_missing_data_file(capfd, recipe, out, tmp_path):
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'nope' / 'train.jsonl'}", f"output_dir={out}"],
          "train.jsonl", "not found", "data.path")
    fails(capfd, ["train", recipe, "data.path=missing.jsonl", f"output_dir={out}"],
          "missing.jsonl", "not found", "data.path")
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'train-*.jsonl'}", f"output_dir={out}"],
          "train-*.jsonl", "is a pattern", "point data.path at the folder")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'loop.jsonl'}", f"output_dir={out}"],
          "loop.jsonl", "leads back to itself (a loop)", "fix the link")
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'dangling.jsonl'}", f"output_dir={out}"],
          "is a link to", "gone.jsonl', which does not exist", "fix the link")
    assert (out / "notes.txt").read_text() == "mine, keep me\n"


def test_data_folder_without_data_files(capfd, recipe, out, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "README.md").write_text("no data here\n")
    fails(capfd, ["train", recipe, f"data.path={folder}", f"output_dir={out}"], "corpus", "holds no", "data file")


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_empty_data_file(capfd, recipe, out, tmp_path, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    before = snapshot(out)
    fails(capfd, ["train", recipe, f"data.path={empty}", f"output_dir={out}"], "empty.jsonl", "empty",
          "add documents")
    assert snapshot(out) == before


def test_dataset_shorter_than_one_sequence(capfd, recipe, out, tmp_path):
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": ""}, {"text": "hi"}, {"text": "ok"}])
    fails(capfd, ["train", recipe, f"data.path={short}", f"output_dir={out}"], "short.jsonl",
          "fewer tokens than one sequence", "data.seq_len=32", "lower data.seq_len")


def test_dataset_smaller_than_global_batch(capfd, recipe, out):
    fails(capfd, ["train", recipe, "train.global_batch_size=4096", f"output_dir={out}"],
          "train.global_batch_size=4096", "lower the batch size")


@pytest.mark.parametrize("row, run_format, hint", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "text", "look like chat data: set data.format=chat"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "instruct",
     "set data.format=chat data.messages_field=conversations"),
    ({"instruction": "say hi", "output": "hi"}, "chat", "look like instruct data: set data.format=instruct"),
    ({"instruction": "say hi", "output": "hi"}, "text", "look like instruct data"),
])
def test_data_of_another_format_is_named_as_such(capfd, recipe, out, tmp_path, row, run_format, hint):
    """A chat dataset given to a text run said only 'set data.text_field to use its columns:
    messages', which no text column would satisfy."""
    path = write_jsonl(tmp_path / "rows.jsonl", [row] * 10)
    fails(capfd, ["train", recipe, f"data.path={path}", f"data.format={run_format}", "data.seq_len=64",
                  f"output_dir={out}"], hint)


def test_missing_text_field(capfd, recipe, out, tmp_path):
    rows = [{"content": f"document number {i} " * 20} for i in range(10)]
    path = write_jsonl(tmp_path / "content.jsonl", rows)
    fails(capfd, ["train", recipe, f"data.path={path}", f"output_dir={out}"], "no column 'text'",
          "data.text_field", "content")
    # ... and naming the right field makes the same data acceptable to that check
    fails(capfd, ["train", recipe, f"data.path={path}", "data.text_field=body", f"output_dir={out}"],
          "no column 'body'", "content")


@pytest.mark.parametrize("line, words", [
    ('{"text": not json', ["line 32 of", "is not JSON", "at character 10"]),
    ("[1, 2]", ["line 32 of", "holds a JSON list", "not an object"]),
    ('"just text"', ["line 32 of", "holds a JSON str"]),
    ("17", ["line 32 of", "holds a JSON int"]),
])
def test_malformed_jsonl_names_the_line(capfd, recipe, out, tmp_path, line, words):
    """arrow's parse error names no line ("Column() changed from object to string in row 0")."""
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"text": "fine and long enough to be a document of its own"}\n' * 30 + "\n" + line + "\n")
    fails(capfd, ["train", recipe, f"data.path={bad}", f"output_dir={out}"], "broken.jsonl", *words)


@pytest.mark.parametrize("odd", [5, {"a": 1}, [1, "x"], True])
def test_a_text_column_mixing_kinds_names_a_value(capfd, recipe, out, tmp_path, odd):
    """`datasets` holds such a column as JSON text ("holds extension<arrow.json>" told nothing)."""
    rows = [{"text": "a document of plain words " * 8}] * 40 + [{"text": odd}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    fails(capfd, ["train", recipe, f"data.path={path}", f"output_dir={out}"], "mixed.jsonl",
          "mixes text with other values", f"one row holds {json.dumps(odd, separators=(',', ':'))}")


@pytest.mark.parametrize("rows, extra, words", [
    ([{"text": 5}] * 20, [], ["column 'text'", "holds int64", "data.text_field"]),
    ([{"text": None}] * 20, [], ["null or empty in all"]),
    ([{"text": " "}] * 20, [], ["null or empty in all"]),
    ([{"instruction": "say hi", "output": ""}] * 20, ["data.format=instruct"],
     ["column 'output'", "data.output_field"]),
    ([{"messages": None}] * 20, ["data.format=chat"], ["column 'messages'", "null or empty in all"]),
])
def test_columns_that_hold_no_text(capfd, recipe, out, tmp_path, rows, extra, words):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    fails(capfd, ["train", recipe, f"data.path={path}", *extra, f"output_dir={out}"], "rows.jsonl", *words)


def test_splits_whose_columns_disagree_name_the_file(capfd, recipe, out, tmp_path):
    """A folder's validation file lacking the text column (or holding none) is named by file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": f"document number {i} " * 20} for i in range(20)])
    write_jsonl(folder / "validation.jsonl", [{"body": "held out " * 20}] * 5)
    fails(capfd, ["train", recipe, f"data.path={folder}", f"output_dir={out}"], "validation.jsonl",
          "no column 'text'", "data.text_field")
    write_jsonl(folder / "validation.jsonl", [{"text": None}] * 5)
    fails(capfd, ["train", recipe, f"data.path={folder}", f"output_dir={out}"], "validation.jsonl",
          "null or empty in all 5 rows")


@pytest.mark.parametrize("raw, words", [
    (b'null\n{"text": "a"}\n', ["line 1 is `null`"]),  # pyarrow's JSON reader would crash the process
    ('{"text": "a"}\n{"text": "café"}\n'.encode("latin-1"), ["not UTF-8 text", "line 2"]),
])
def test_data_file_bytes(capfd, recipe, out, tmp_path, raw, words):
    (tmp_path / "train.jsonl").write_bytes(raw)
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'train.jsonl'}", f"output_dir={out}"], *words)


def test_data_path_that_is_a_fifo(capfd, recipe, out, tmp_path):
    os.mkfifo(tmp_path / "train.txt")
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'train.txt'}", f"output_dir={out}"], "not a regular file")
    fails(capfd, ["train", recipe, f"data.path={tmp_path}", f"output_dir={out}"], "not a regular file")


def _docs(folder: Path, name: str, n: int = 20) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / name, [{"text": f"document number {i} " * 20} for i in range(n)])


def _parquet(path: Path, **columns) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


# A data folder or file laid out in a way the readers cannot take: each is the file's fault (named,
# with the fix), never a write failure, a network hint or the reader's own words about "instructions".
ODD_LAYOUTS = {
    "a-folder-named-train.jsonl": (lambda d: ((d / "train.jsonl").mkdir(), _docs(d, "validation.jsonl")),
                                   ["train.jsonl", "is a folder, not a file"]),
    "a-dangling-link": (lambda d: (_docs(d, "train.jsonl"), (d / "validation.jsonl").symlink_to(d / "gone.jsonl")),
                        ["validation.jsonl", "is a link to", "does not exist"]),
    "files-only-in-a-subfolder": (lambda d: _docs(d / "sub", "train.jsonl"), ["subfolders are not read"]),
    "json-objects-without-fields": (lambda d: (d / "train.jsonl").write_text("{}\n" * 20),
                                    ["train.jsonl", "no records with fields"]),
    "a-csv-header-alone": (lambda d: (d / "train.csv").write_text("text\n"), ["train.csv", "no records"]),
    "a-parquet-of-no-rows": (lambda d: _parquet(d / "train.parquet", text=__import__("pyarrow").array([], "string")),
                             ["train.parquet", "is empty"]),
    "one-split-in-files-of-other-columns": (
        lambda d: (_docs(d, "train.jsonl"), (d / "train-more.jsonl").write_text('{"body": "x y", "n": 1}\n' * 20)),
        ["train-more.jsonl has body, n", "train.jsonl has text", "same columns"]),
    "one-csv-split-in-files-of-other-columns": (
        lambda d: ((d / "train.csv").write_text("text\nsome words\n" * 20), (d / "train2.csv").write_text("a\nb\n")),
        ["train2.csv has a", "train.csv has text", "same columns"]),
    "not-a-parquet-file": (lambda d: (d / "train.parquet").write_bytes(b"PAR1 not really"),
                           ["train.parquet", "not a readable parquet file"]),
}


@pytest.mark.parametrize("layout", ODD_LAYOUTS)
def test_odd_data_layouts_name_the_file_and_the_fix(capfd, recipe, out, tmp_path, layout):
    make, words = ODD_LAYOUTS[layout]
    folder = tmp_path / "corpus"
    folder.mkdir()
    make(folder)
    before = snapshot(folder)
    line = fails(capfd, ["train", recipe, f"data.path={folder}", f"output_dir={out}"], *words)
    assert "cannot write" not in line and "network" not in line and "Instruction" not in line, line
    assert snapshot(folder) == before and (out / "notes.txt").read_text() == "mine, keep me\n"


def test_data_file_suffixes_in_any_case_are_read(tmp_path):
    """TRAIN.JSONL is a jsonl file: it was skipped, and the folder said to hold no data files."""
    from shardtune.data.files import local_files

    _docs(tmp_path, "TRAIN.JSONL")
    _docs(tmp_path, "Validation.Jsonl", 5)
    assert local_files(tmp_path) == {"train": [str(tmp_path / "TRAIN.JSONL")],
                                     "validation": [str(tmp_path / "Validation.Jsonl")]}


@pytest.mark.parametrize("inputs, words", [
    ([5] * 20, ["column 'input'", "holds int64", "data.input_field"]),
    ([{"a": 1}] * 20, ["column 'input'", "holds struct"]),
    (["context"] * 19 + [7], ["column 'input'", "mixes text with other values", "one row holds 7"]),
])
def test_an_instruct_input_that_is_not_text_is_refused(capfd, recipe, out, tmp_path, inputs, words):
    """The input column may be absent or empty in every row, but a number or record there was
    trained on as its repr ("{'a': 1}") without a word."""
    rows = [{"instruction": "say hi", "input": x, "output": "hi"} for x in inputs]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    fails(capfd, ["train", recipe, f"data.path={path}", "data.format=instruct", "data.val_size=0",
                  f"output_dir={out}"], "alpaca.jsonl", *words)


@pytest.mark.parametrize("splits, words", [
    (None, ["the dataset that save_to_disk wrote", "has no rows"]),
    ({"train": 20, "validation": 0}, ["split 'validation' of the dataset that save_to_disk wrote", "has no rows"]),
])
def test_a_saved_dataset_of_no_rows_is_refused(capfd, recipe, out, tmp_path, splits, words):
    """load_from_disk fails on a saved split of no rows with an IndexError (a traceback)."""
    import datasets

    def docs(n: int):
        return datasets.Dataset.from_dict({"text": [f"document number {i} " * 20 for i in range(n)]})

    saved = docs(0) if splits is None else datasets.DatasetDict({k: docs(n) for k, n in splits.items()})
    saved.save_to_disk(str(tmp_path / "saved"))
    fails(capfd, ["train", recipe, f"data.path={tmp_path / 'saved'}", f"output_dir={out}"], *words)
