"""Data that the `datasets` readers would misread, refused. A .json table written by columns
(columns_in_one_row). A value of another kind, in a column the run reads, than the split's
(check_kinds): a reader takes a split's types from its first file (a JSON file's first block, 10
MiB) and turns every later value into them, a number into its digits and (JSON) a record or list
into its JSON text (`{"k":1}`, `["a","b"]`), while the same values inside one JSON block are a
column of mixed JSON that the format checks refuse. A shard of numbers or a late row of records
trained as text without a word. A parquet or arrow file's types are in its header; a JSON-lines
file is parsed again by pyarrow's JSON parser, a few MB of whole lines at a time, with the split's
types for those columns alone (the others skipped), at a few times the speed of the reader."""

from __future__ import annotations

import re
from pathlib import Path

from shardtune.data.layouts import kind_of, opened
from shardtune.errors import UserError, first_line

BLOCK = 10 << 20  # the JSON reader's block (JsonConfig.chunksize): one file below it is read in one


def check_kinds(files: dict[str, list[str]], splits, columns: list[str]) -> None:
    """Refuse a value of another kind in `columns` of the data `files` (by split, as read into
    `splits`) than its split's type, naming the file (and a JSON record) and both kinds."""
    import pyarrow as pa

    for split, names in files.items():
        first = kind_of(names[0])
        if first is None or first.format.builder not in ("json", "parquet", "arrow") or split not in splits:
            continue
        one_block = first.format.builder != "json" or first.codec is None and Path(names[0]).stat().st_size <= BLOCK
        if len(names) == 1 and one_block:
            continue  # one type per column, or (JSON) a column of mixed JSON (formats.check_cells)
        schema = splits[split].data.schema
        wanted = pa.schema([schema.field(c) for c in dict.fromkeys(columns) if c in schema.names
                            and not isinstance(schema.field(c).type, pa.ExtensionType)])
        for name in names if len(wanted) else ():
            if first.format.builder == "json":
                _check_json(name, wanted)
            elif (odd := next(((c, t) for c, t in _header(name, first.format.builder) if c in wanted.names
                               and _kind(t) != _kind(wanted.field(c).type)), None)) is not None:
                raise UserError(f"data file {name!r}: column {odd[0]} holds {odd[1]} where the split's first file "
                                f"holds {wanted.field(odd[0]).type}; the reader would turn its values into those and "
                                "train on that: make the column of one kind in every file")


def _header(name: str, builder: str) -> list:
    """(column, type) of a parquet or arrow file, from its header."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if builder == "parquet":
        schema = pq.read_schema(name)
    else:
        with pa.memory_map(name) as source:
            try:
                schema = pa.ipc.open_stream(source).schema
            except pa.ArrowInvalid:  # the IPC file layout (Feather v2), which the reader takes too
                schema = pa.ipc.open_file(source).schema
    return list(zip(schema.names, schema.types))


def _kind(kind) -> object:
    """A type as a kind of value: every text type one (string, large_string, a dictionary of text),
    lists by what they hold, records by their fields'."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return "text"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return ("list", _kind(kind.value_type))
    if pa.types.is_struct(kind):
        return ("record", tuple(sorted((f.name, repr(_kind(f.type))) for f in kind)))
    return str(kind)


def columns_in_one_row(ds, names: list[str]) -> str | None:
    """A refusal of a .json split that is one object whose every value is a list of plain values
    (text, numbers), all of one length (2 or more): a table written by columns (`json.dump` of
    `{"text": [...]}` or of `ds.to_dict()`), which the reader takes as one record: its lists were
    joined into one document (one instruct example) without a word. None for any other split."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if len(ds) != 1 or any(kind_of(n).suffix != ".json" for n in names):
        return None  # a JSON-lines file is one record a line, whatever it holds
    columns = ds.data.table.columns

    def plain_list(kind) -> bool:
        return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and not pa.types.is_nested(kind.value_type)

    if not all(plain_list(c.type) for c in columns):
        return None
    lengths = {pc.list_value_length(c)[0].as_py() or 0 for c in columns}
    if len(lengths) != 1 or (count := lengths.pop()) < 2:
        return None
    return (f"data file(s) {', '.join(repr(n) for n in names)} hold one JSON object of columns "
            f"({', '.join(ds.column_names)}: {count} values each), which the reader takes as one record, its lists "
            "joined into one document; write one object per record (JSON lines, or a list of objects)")


def _check_json(name: str, schema) -> None:
    import pyarrow as pa
    import pyarrow.json as paj

    options = paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    with opened(name) as f:
        if f.read(1 << 12).lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
            return  # a .json array is read whole, by pandas, not in blocks
    done = 0
    for lines in _whole_lines(name):
        if not lines.strip():
            continue
        try:  # one block of whole records: pyarrow's own streaming reader read ahead, ~half the file held
            done += paj.read_json(pa.BufferReader(lines), read_options=paj.ReadOptions(
                block_size=len(lines) + 1, use_threads=False), parse_options=options,
                memory_pool=pa.system_memory_pool()).num_rows
        except pa.ArrowInvalid as exc:
            m = re.search(r"Column\(/([^)]*)\) changed from (\w+) to (\w+) in row (\d+)", str(exc))
            if m is None:
                raise UserError(f"could not read data file {name!r} ({first_line(exc)}); fix the file or point "
                                "data.path elsewhere") from None
            column, was, now, row = m.groups()
            raise UserError(f"data file {name!r}, record {done + int(row) + 1}: {column.replace('/[]', '[]')} is "
                            f"{_a(now)} where the split's first records hold {_a(was)}; the reader would turn it "
                            f"into {_a(was)} (a record or list into its JSON text) and train on that: make it "
                            f"{_a(was)} in every file, or drop the record") from None


def _whole_lines(name: str, size: int = 1 << 20):
    """The file's bytes in blocks of about `size` that end at a line's end (a longer line: a block of
    its own), so the check holds a few blocks whatever the file's size."""
    rest = b""
    with opened(name) as f:
        while data := f.read(size):
            data, rest = rest + data, b""
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            yield data[:cut]
            rest = data[cut:]
    if rest.strip():
        yield rest


def _a(kind: str) -> str:
    """pyarrow's word for a JSON kind, with its article: `an object`, `a number`."""
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"
