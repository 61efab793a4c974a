"""Dataset formats: turn rows of any shape into token ids (and loss labels).

- text:     one document per row, from `data.text_field` or a `data.template` over several
            columns; list-valued columns are joined into one line. Packed later by data.pack.
- instruct: an alpaca-style prompt (instruction [+ input]) followed by the response and EOS;
            prompt tokens get no loss unless `data.train_on_inputs`.
- chat:     a list of {role, content} (or ShareGPT {from, value}) messages rendered with the tokenizer's chat template;
            only what the assistant would generate (its turns, with the template's end-of-turn
            marker) gets loss.

Everything here is called inside `datasets.map`, so it must be picklable and deterministic.
Problems a user can fix are raised as one-line UserErrors.
"""

from __future__ import annotations

import functools
import string

from shardtune.config.schema import DataConfig
from shardtune.config.validation import template_columns
from shardtune.data.messages import check_message_contents, content_key
from shardtune.errors import UserError, first_line

IGNORE_INDEX = -100

# Our own wording of the usual alpaca layout; the ### headers are kept because models tuned on
# alpaca-style data recognise them.
PROMPT_WITH_INPUT = (
    "Below is a task to carry out, written as an instruction, together with input that gives it "
    "more context. Write a reply that fulfils the task.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = (
    "Below is a task to carry out, written as an instruction. Write a reply that fulfils the task.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n")


# ----------------------------------------------------------------------------- column templates


def as_text(value, sep: str = " "):
    """A cell as template input: None -> "", lists joined (chess moves -> "e4 e5 Nf3")."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return sep.join(str(as_text(v, sep)) for v in value)
    return value


def check_columns(wanted: list[str], columns: list[str], what: str, key: str, hint: str = "") -> None:
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise UserError(f"{what} has no column {missing[0]!r}, which {key} names; set {key} to use "
                        f"its columns: {', '.join(columns)}{hint}")


# columns that say a dataset's format, whatever the run's data.format says: (format, columns, its keys)
FORMAT_COLUMNS = (("chat", ("messages",), ""), ("chat", ("conversations",), " data.messages_field=conversations"),
                  ("instruct", ("instruction", "output"), ""))


def format_hint(cfg: DataConfig, columns) -> str:
    """' (its columns look like chat data: data.format=chat)' where a dataset's columns are
    another format's, for a refusal of a missing column; else ''."""
    for fmt, named, keys in FORMAT_COLUMNS:
        if fmt != cfg.format and set(named) <= set(columns):
            return f" (its columns look like {fmt} data: set data.format={fmt}{keys})"
    return ""


def read_columns(cfg: DataConfig) -> list[tuple[str, str, bool]]:
    """(column, config key, may be empty) of the columns whose values the format turns into tokens
    by itself (a template's columns may hold anything: numbers, null cells). An instruct row's
    input is optional, so it may be empty in every row, but never anything but text."""
    if cfg.format == "chat":
        return [(cfg.messages_field, "data.messages_field", False)]
    if cfg.format == "instruct":
        own = [] if cfg.template is not None else [(cfg.instruction_field, "data.instruction_field", False),
                                                   (cfg.input_field, "data.input_field", True)]
        return [*own, (cfg.output_field, "data.output_field", False)]
    return [] if cfg.template is not None else [(cfg.text_field, "data.text_field", False)]


def check_cells(docs, cfg: DataConfig, what: str, warn, tokenizer=None) -> None:
    """Refuse a column the format reads that is null or empty in every row, or that holds no text
    (numbers, records), naming the column and the count; `warn` gets the count when only some
    rows are empty (those rows train on nothing, or on an empty response), and, given the
    `tokenizer`, when some hold a special token's text (special_text). Read a chunk of rows at
    a time (scan.py): a column read whole would be a copy of the corpus."""
    import pyarrow as pa

    from shardtune.data.scan import ArrowChunks

    specials = special_text(tokenizer) if tokenizer is not None else None
    for column, key, may_be_empty in read_columns(cfg):
        if column not in docs.column_names or len(docs) == 0:
            continue  # check_columns names a missing column
        kind = docs.data.schema.field(column).type
        texts = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        lists = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        wants = "lists of {role, content} messages" if cfg.format == "chat" else "text (or lists of text)"
        # data.template formats a document or a prompt from other columns, never a response or messages
        other = (", or use data.template to format other columns" if cfg.format == "text" or key != "data.output_field"
                 and cfg.format != "chat" else "")
        if pa.types.is_null(kind):
            empty = len(docs)
        elif (cfg.format != "chat" and texts) or (lists and (cfg.format == "chat" or pa.types.is_string(
                kind.value_type) or pa.types.is_large_string(kind.value_type))):
            messages = cfg.format == "chat" and lists and pa.types.is_struct(kind.value_type)
            empty = first = marked = 0
            found: set[str] = set()
            for chunk in ArrowChunks(docs, [column]):
                cells = chunk.column(column)
                empty += _empty_cells(cells, texts)
                if messages:
                    check_message_contents(cells, f"column {column!r} of {what} ({key})", first)
                if specials:
                    rows, texts_found = _rows_matching(cells, specials)
                    marked, found = marked + rows, found | texts_found
                first += len(cells)
            if marked:
                warn(_special_warning(marked, len(docs), f"column {column!r} of {what} ({key})", found))
        elif getattr(kind, "extension_name", None) == "arrow.json" and cfg.format != "chat":
            # `datasets` holds a JSON column whose values mix kinds (text here, 5 or {...} there) as JSON
            # text; a split whose own values are all text tokenizes (another split may hold the others)
            if (odd := _first_not_text(docs, column)) is not None:
                raise UserError(f"column {column!r} of {what} ({key}) mixes text with other values (one row holds "
                                f"{odd}); make those rows text (or lists of text){other}")
            continue
        else:
            raise UserError(f"column {column!r} of {what} ({key}) holds {kind}, not {wants}; point {key} at the "
                            f"right column{other or ', or write its values as text'}")
        if may_be_empty:
            continue
        if empty == len(docs):
            raise UserError(f"column {column!r} of {what} ({key}) is null or empty in all {empty} rows; point "
                            f"{key} at the column that holds the {'messages' if cfg.format == 'chat' else 'text'}")
        if empty:
            warn(f"warning: column {column!r} of {what} ({key}) is null or empty in {empty} of {len(docs)} rows")
    read = {column for column, _, _ in read_columns(cfg)}
    for column in dict.fromkeys(template_columns(cfg.template)) if specials and cfg.template is not None else []:
        if column in docs.column_names and column not in read:  # a template's columns: read by no check above
            counts = [_rows_matching(chunk.column(column), specials) for chunk in ArrowChunks(docs, [column])]
            if marked := sum(n for n, _ in counts):
                found = set().union(*(f for _, f in counts))
                warn(_special_warning(marked, len(docs), f"column {column!r} of {what} (data.template)", found))


def _special_warning(marked: int, rows: int, where: str, found: set[str]) -> str:
    return (f"warning: {marked} of {rows} rows of {where} hold the text of a special token "
            f"({', '.join(sorted(found)[:3])}), read as that token, as transformers reads it (README 'Data formats'); "
            "remove that text from the data if it is meant as words")


def special_text(tokenizer) -> str | None:
    """A regex of the texts of the tokenizer's special tokens, or None where it has none.
    Such a text in the data is read as the token, whatever the format (transformers' tokenizer
    and apply_chat_template read it so): an <|endoftext|> inside a document ends it for the model,
    an <|im_end|> inside a reply ends the turn. The rule is kept, and said."""
    import re

    texts = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
                    and t.content.strip()}, key=lambda t: (-len(t), t))
    return "|".join(map(re.escape, texts)) if texts else None


def _rows_matching(cells, pattern: str) -> tuple[int, set[str]]:
    """(how many of these cells hold a match of `pattern` somewhere in their text, the texts
    matched first in each): text cells, lists of text, or messages (their content, itself text
    or a list of text parts)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = cells.combine_chunks() if isinstance(cells, pa.ChunkedArray) else cells
    rows = None  # the row of each value, once lists are flattened
    while not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
            return 0, set()  # not text (a refusal names it)
        inner = values.type.value_type
        names = [inner.field(i).name for i in range(inner.num_fields)] if pa.types.is_struct(inner) else []
        if "text" in names and content_key(names) is None:  # a content's text parts, read joined (messages.py)
            texts = pc.struct_field(pc.list_flatten(values), "text")
            values = pc.binary_join(pa.ListArray.from_arrays(pc.subtract(values.offsets, values.offsets[0]), texts), "")
            continue
        parents = pc.list_parent_indices(values)
        rows, values = parents if rows is None else pc.take(rows, parents), pc.list_flatten(values)
        if names:  # messages: their content
            values = pc.struct_field(values, content_key(names) or names[0])
    hit = pc.fill_null(pc.match_substring_regex(values, pattern), False)
    found = set(pc.struct_field(pc.extract_regex(pc.filter(values, hit), f"(?P<t>{pattern})"), "t").to_pylist())
    return pc.sum(hit, min_count=0).as_py() if rows is None else len(pc.unique(pc.filter(rows, hit))), found


def _first_not_text(docs, column: str) -> str | None:
    """The first value, as JSON, that is not text in a column `datasets` holds as JSON text, or
    None when all of them are text (strings are the JSON values that start with a quote)."""
    import pyarrow.compute as pc

    from shardtune.data.scan import ArrowChunks

    for chunk in ArrowChunks(docs, [column]):
        storage = chunk.column(column).combine_chunks().storage
        odd = pc.filter(storage, pc.invert(pc.starts_with(storage, '"')))
        if len(odd):
            return str(odd[0].as_py())[:60]
    return None


def _empty_cells(cells, texts: bool) -> int:
    """How many of these cells (strings, or lists) are null, blank text or an empty list."""
    import pyarrow.compute as pc

    blank = pc.equal(pc.utf8_trim_whitespace(cells), "") if texts else pc.equal(pc.list_value_length(cells), 0)
    return cells.null_count + pc.sum(blank, min_count=0).as_py()


class _Cells(string.Formatter):
    """str.format over a row's cells as they are: {moves[0]} is a list column's first item and
    {rec[key]} a record's field; only the value a field names is made text (as_text), so an
    index is not taken in the joined line and a record's null field is "", not "None"."""

    def __init__(self, sep: str):
        self.sep = sep

    def get_field(self, field_name, args, kwargs):
        value, used = super().get_field(field_name, args, kwargs)
        if callable(value):  # {quote.upper}: a method's repr, with its address, would be the text
            raise TypeError(f"{{{field_name}}} is a method of the column's {type(value.__self__).__name__} values, "
                            "not a value" if hasattr(value, "__self__") else f"{{{field_name}}} is not a value")
        record = next((v for v in (value if isinstance(value, list) else [value]) if isinstance(v, dict)), None)
        if record is not None:  # a Python dict's repr, with None for the fields other rows have, would be the text
            raise TypeError(f"{{{field_name}}} holds records (fields {', '.join(map(str, record))}), not text; name a "
                            f"field, e.g. {{{field_name}[{next(iter(record), 'field')}]}}")
        return value, used

    def convert_field(self, value, conversion):
        return super().convert_field(as_text(value, self.sep), conversion)


@functools.lru_cache(maxsize=64)
def _plain_names(template: str) -> tuple[str, ...] | None:
    """The fields of a template that names whole cells only ({title}: no index, attribute or
    position), else None."""
    names = tuple(f for _, f, _, _ in string.Formatter().parse(template) if f is not None)
    return None if any(not n or n.isdigit() or "." in n or "[" in n for n in names) else names


def _holds_records(value) -> bool:
    return isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict) for v in value))


def fill(template: str, row: dict, sep: str = " ") -> str:
    try:
        names = _plain_names(template)
        cells = {n: row[n] for n in names} if names is not None else None
        if cells is not None and not any(_holds_records(v) for v in cells.values()):
            # whole cells made text: what _Cells gives them, at str.format's own speed (most templates)
            return template.format_map({n: as_text(v, sep) for n, v in cells.items()})
        return _Cells(sep).vformat(template, (), row)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:  # a spec the cell's type refuses
        raise UserError(f"data.template={template!r} cannot format a row ({type(exc).__name__}: "
                        f"{first_line(exc, 100)}); fix the template to suit the column's values") from None


def _rows(batch: dict) -> list[dict]:
    """A batched `datasets.map` input as one dict per row."""
    keys = list(batch)
    return [dict(zip(keys, values)) for values in zip(*(batch[k] for k in keys))]


def render_text(docs, cfg: DataConfig, what: str):
    """(docs, field) where docs[field] is one plain string per document, for packing.
    Plain string columns pass through untouched (no extra map, no extra cache)."""
    import datasets

    if cfg.template is None:
        check_columns([cfg.text_field], docs.column_names, what, "data.text_field", format_hint(cfg, docs.column_names))
        feature = docs.features[cfg.text_field]
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            return docs, cfg.text_field

        def text(row):  # the column as it is, not through a template: a name like "a.b" is no attribute
            return str(as_text(row[cfg.text_field], cfg.list_sep))
    else:
        check_columns(template_columns(cfg.template), docs.column_names, what, "data.template")

        def text(row):
            return str(fill(cfg.template, row, cfg.list_sep))

    def render(batch):
        return {"text": [text(row) for row in _rows(batch)]}

    docs = docs.map(render, batched=True, remove_columns=docs.column_names, num_proc=cfg.num_proc,
                    desc="render")
    return docs, "text"


# ----------------------------------------------------------------------------- instruct


def leading_bos(tokenizer) -> list[int]:
    """[bos] if this tokenizer puts BOS before text by itself (llama-style: Llama, Mistral, Gemma,
    OPT), else []: what every document, instruct prompt and text prompt starts with, as the model's
    own pretraining did. Done by hand so that a tokenizer that also appends EOS (add_eos_token)
    does not end a prompt with one."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if bos is not None and ids and ids[0] == bos and len(ids) > 1 else []


def with_ends(ids: list[int], bos: list[int], eos: int | None = None) -> list[int]:
    """`ids` after `bos` and before `eos` (None: none), each unless the text already wrote it: a
    document or template that holds <s>...</s> (Llama-2 data laid out by hand) gets one BOS and
    one EOS, not two of each."""
    head = bos if bos and ids[:1] != bos else []
    return head + ids + ([eos] if eos is not None and ids[-1:] != [eos] else [])


def instruct_prompt(cfg: DataConfig, row: dict) -> str:
    """The prompt part of one instruct row: data.template over its columns, else the alpaca layout
    (with the input section only where the row has a non-empty input)."""
    sep = cfg.list_sep
    if cfg.template is not None:
        return str(fill(cfg.template, row, sep))
    text_in = str(as_text(row.get(cfg.input_field), sep)).strip()
    base = PROMPT_WITH_INPUT if text_in else PROMPT_NO_INPUT
    return base.format(instruction=str(as_text(row[cfg.instruction_field], sep)).strip(), input=text_in)


def text_ids(tokenizer, text: str, bos: list[int] | None = None) -> list[int]:
    """`text`'s token ids after the BOS training puts before a document or prompt (leading_bos, or
    `bos` where the caller has it), not doubled where the text writes it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return with_ends(ids, leading_bos(tokenizer) if bos is None else bos)


def instruct_prompt_ids(cfg: DataConfig, tokenizer, row: dict) -> list[int]:
    """The prompt's token ids exactly as training saw them (a llama-style BOS included)."""
    return text_ids(tokenizer, instruct_prompt(cfg, row))


def instruct_response(cfg: DataConfig, row: dict) -> str:
    """The response part of one instruct row, as training scores it (before its EOS) and as
    `eval --generate` compares a generation with it: a list cell joined with data.list_sep."""
    return str(as_text(row[cfg.output_field], cfg.list_sep))


def instruct_fn(cfg: DataConfig, tokenizer, columns: list[str], what: str):
    """Batched map function: rows -> {input_ids, labels, length}."""
    needed = [(cfg.output_field, "data.output_field")]
    if cfg.template is not None:
        check_columns(template_columns(cfg.template), columns, what, "data.template")
    else:
        needed.insert(0, (cfg.instruction_field, "data.instruction_field"))
        if cfg.input_field != DataConfig.input_field:  # the default `input` column may be absent (no inputs)
            needed.append((cfg.input_field, "data.input_field"))
    for col, key in needed:
        if col not in columns:
            raise UserError(f"data.format=instruct needs a column {col!r} but {what} has only: "
                            f"{', '.join(columns)}; set {key} to the right column{format_hint(cfg, columns)}")
    bos, eos = leading_bos(tokenizer), tokenizer.eos_token_id
    cutoff = cfg.example_cutoff

    def build(batch):
        rows = _rows(batch)
        prompts = tokenizer([instruct_prompt(cfg, r) for r in rows], add_special_tokens=False)["input_ids"]
        answers = tokenizer([instruct_response(cfg, r) for r in rows], add_special_tokens=False)["input_ids"]
        out = new_examples()
        for p, a in zip(prompts, answers):
            p, a = with_ends(p, bos), with_ends(a, [], eos)
            add_example(out, p + a, p + a if cfg.train_on_inputs else [IGNORE_INDEX] * len(p) + a, cutoff)
        return out

    return build


def new_examples() -> dict:
    """The `datasets.map` columns of a batch of tokenized examples; `cut` marks those with loss
    tokens past the cutoff (tokenize_split counts them, then drops the column)."""
    return {"input_ids": [], "labels": [], "length": [], "cut": []}


def add_example(out: dict, ids: list, labels, cutoff: int) -> None:
    """One tokenized example into a batch of `datasets.map` columns, cut to `cutoff` tokens."""
    out["input_ids"].append(ids[:cutoff])
    out["labels"].append(list(labels[:cutoff]))
    out["length"].append(min(len(ids), cutoff))
    out["cut"].append(any(t != IGNORE_INDEX for t in labels[cutoff:]))
