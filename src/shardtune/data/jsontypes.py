"""JSON data that the `datasets` reader would misread, refused. A .json table written by columns
(columns_in_one_row). A value of another kind, in a column the run reads, than the split's
(check_json_types): the reader takes a split's types from its first block (10 MiB of its first
file) and turns every later value into them, a number into its digits and a record or a list
into its JSON text (`{"k":1}`, `["a","b"]`), while the same values inside one block are a column
of mixed JSON that the format checks refuse. A shard of numbers or a late row of records trained
as text without a word. Each file is parsed again by pyarrow's streaming reader with the split's
types for those columns alone (the others skipped), at a few times the speed of the reader."""

from __future__ import annotations

import re
from pathlib import Path

from shardtune.data.layouts import kind_of, opened
from shardtune.errors import UserError, first_line

BLOCK = 10 << 20  # the reader's block (JsonConfig.chunksize): one file below it is read in one


def check_json_types(files: dict[str, list[str]], splits, columns: list[str]) -> None:
    """Refuse a value of another kind in `columns` of the JSON-lines `files` (by split, as read
    into `splits`) than its split's type, naming the file, the record and both kinds."""
    import pyarrow as pa

    for split, names in files.items():
        first = kind_of(names[0])
        if first is None or first.format.builder != "json" or split not in splits:
            continue
        if len(names) == 1 and first.codec is None and Path(names[0]).stat().st_size <= BLOCK:
            continue  # one block: one type per column, or a column of mixed JSON (formats.check_cells)
        schema = splits[split].data.schema
        wanted = [schema.field(c) for c in dict.fromkeys(columns) if c in schema.names
                  and not isinstance(schema.field(c).type, pa.ExtensionType)]
        for name in names if wanted else ():
            _check_file(name, pa.schema(wanted))


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


def _check_file(name: str, schema) -> None:
    import pyarrow as pa
    import pyarrow.json as paj

    options = paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    done = 0
    with opened(name) as f:
        if f.read(1 << 12).lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
            return  # a .json array is read whole, by pandas, not in blocks
    with opened(name) as f:
        try:
            for batch in paj.open_json(f, parse_options=options):
                done += batch.num_rows
        except pa.ArrowInvalid as exc:
            m = re.search(r"Column\(/([^)]*)\) changed from (\w+) to (\w+) in row (\d+)", str(exc))
            if m is None:
                raise UserError(f"could not read data file {name!r} ({first_line(exc)}); fix the file or point "
                                "data.path elsewhere") from None
            column, was, now, row = m.groups()
            raise UserError(f"data file {name!r}, record {done + int(row) + 1}: {column.replace('/[]', '[]')} is "
                            f"{_a(now)} where the split's first records hold {_a(was)}; the reader would turn it into "
                            f"{_a(was)} (a record or list into its JSON text) and train on that: make it {_a(was)} "
                            "in every file, or drop the record") from None


def _a(kind: str) -> str:
    """pyarrow's word for a JSON kind, with its article: `an object`, `a number`."""
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"
