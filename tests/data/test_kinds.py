"""data/kinds.py: data the readers would misread: a column the run reads holds one kind of value in
every file; a .json table written by columns."""

from __future__ import annotations

import gzip
import json

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import pipeline as D
from shardtune.data.files import read_path
from shardtune.errors import UserError

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize(("fmt", "first", "later", "refused"), [
    ("text", {"text": "a"}, {"text": 5}, "text is a number where the split's first records hold a string"),
    ("text", {"text": "a"}, {"text": {"k": 1}}, "text is an object where"),  # trained as '{"k":1}'
    ("text", {"text": "a"}, {"text": True}, "text is a boolean where"),
    ("text", {"text": ["e4", "e5"]}, {"text": "x"}, ""),  # refused by the reader itself (no cast from text)
    ("text", {"text": "a"}, {"text": None}, None),
    ("text", {"text": "a", "id": "x7"}, {"text": "b", "id": 7}, None),  # a column the run does not read
    ("instruct", {"instruction": "a", "output": "b"}, {"instruction": "a", "output": 4}, "output is a number"),
    ("chat", {"messages": MESSAGES}, {"messages": [{**MESSAGES[0], "content": 5}]}, "messages[]/content is a number"),
    # refused by the reader itself, its types in the one line (a cast's types span lines: they were cut off)
    ("chat", {"messages": MESSAGES}, {"messages": [{**MESSAGES[0], "weight": 1}]}, "(Couldn't cast array of type "
     "struct<role: string, content: string, weight: int64> to {'role': Value('string'), 'content': Value('string')})"),
])
def test_a_value_of_another_kind_in_a_later_file_is_refused_not_turned_into_text(tmp_path, fmt, first, later,
                                                                                 refused):
    """The reader takes a split's types from its first block and turns later values into them: a later
    shard's number became its digits, a record its JSON text ('{"k":1}'), trained on without a word (the
    same values in one block are refused by the format's checks). Past the first 10 MiB of one file
    alike: a later file stands for a later block here."""
    (tmp_path / "train-00000.jsonl").write_text(json.dumps(first) + "\n")
    (tmp_path / "train-00001.jsonl").write_text(json.dumps(later) + "\n" + json.dumps(later) + "\n")
    cfg = DataConfig(path=str(tmp_path), format=fmt)
    try:
        splits = D.load_documents(cfg)
    except UserError as exc:
        assert refused is not None and "\n" not in str(exc), exc
        assert refused in str(exc) if refused.startswith("(") else f"train-00001.jsonl', record 1: {refused}" in str(
            exc) or not refused, exc
    else:
        assert refused is None and len(splits["train"]) == 3



@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
@pytest.mark.parametrize(("later", "refused"), [("int64", True), ("bool", True), ("large_string", False),
                                                ("dictionary", False)])
def test_a_later_parquet_or_arrow_file_of_another_kind_is_refused(tmp_path, suffix, later, refused):
    """The same for parquet and arrow shards (their types read from their headers): a later shard's numbers
    became their digits (a column the run does not read may differ); another type of text (large_string,
    a dictionary of text) is the same kind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = {"int64": pa.array([5]), "bool": pa.array([True]), "large_string": pa.array(["b"], pa.large_string()),
              "dictionary": pa.array(["b"]).dictionary_encode()}
    tables = [pa.table({"text": ["a"], "id": ["x"]}), pa.table({"text": values[later], "id": [7]})]
    for number, table in enumerate(tables):
        path = tmp_path / f"train-{number}.{suffix}"
        if suffix == "parquet":
            pq.write_table(table, path)
        else:
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
    try:
        splits = D.load_documents(DataConfig(path=str(tmp_path), text_field="text"))
    except UserError as exc:
        assert refused and f"train-1.{suffix}': column text holds {later} where the split's first file holds string" \
            in str(exc), exc
    else:
        assert not refused and splits["train"]["text"][:] == ["a", "b"]

@pytest.mark.parametrize(("name", "value", "refused"), [
    ("train.json", {"text": ["first document", "second document"]}, True),  # json.dump({"text": texts})
    ("train.json.gz", {"instruction": ["a", "b", "c"], "output": ["x", "y", "z"]}, True),  # json.dump(ds.to_dict())
    ("train.json", {"id": [1, 2], "text": ["one", "two"]}, True),
    ("train.json", {"text": "one document"}, False),  # a single record
    ("train.json", {"moves": ["e4", "e5"], "result": "1-0"}, False),  # one game: a list beside a value
    ("train.json", {"moves": ["e4"]}, False),
    ("train.json", {"a": ["e4", "e5"], "b": ["x"]}, False),  # lists of other lengths: no table
    ("train.json", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, False),
    ("train.jsonl", {"text": ["e4", "e5"]}, False),  # a JSON-lines file: a line is a record
])
def test_a_json_table_written_by_columns_is_refused_not_read_as_one_record(tmp_path, name, value, refused):
    """`{"text": [...]}` (a dict of columns dumped as JSON) is one record to the reader: its documents were
    joined into one (instruct: every instruction into one prompt, every output into one response)."""
    data = json.dumps(value).encode()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    (tmp_path / "validation.jsonl").write_text('{"text": "held out"}\n')
    try:
        splits = read_path(tmp_path, str(tmp_path))
    except UserError as exc:
        assert refused and f"{name}' hold one JSON object of columns" in str(exc) and "\n" not in str(exc), exc
    else:
        assert not refused and len(splits["train"]) == 1


def test_a_record_longer_than_a_block_is_checked_not_refused(tmp_path, monkeypatch):
    """pyarrow's streaming reader refuses a record longer than its block ("straddling"): a long document
    is read again in larger blocks, and a value of another kind after it is still found."""
    from shardtune.data import kinds

    monkeypatch.setattr(kinds, "BLOCK", 64)  # stands for 10 MiB: a 2 KB document is a long one
    (tmp_path / "train-00000.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (tmp_path / "train-00001.jsonl").write_text(json.dumps({"text": "word " * 400}) + "\n")
    assert len(D.load_documents(DataConfig(path=str(tmp_path)))["train"]) == 2
    (tmp_path / "train-00002.jsonl").write_text(json.dumps({"text": "word " * 400}) + "\n" + '{"text": 5}\n')
    with pytest.raises(UserError, match="train-00002.jsonl', record 2: text is a number"):
        D.load_documents(DataConfig(path=str(tmp_path)))
