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

import string

from shardtune.config.schema import DataConfig
from shardtune.config.validation import template_columns
from shardtune.data.messages import check_message_contents, read_messages
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


def check_columns(wanted: list[str], columns: list[str], what: str, key: str) -> None:
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise UserError(f"{what} has no column {missing[0]!r}, which {key} names; set {key} to use "
                        f"its columns: {', '.join(columns)}")


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


def check_cells(docs, cfg: DataConfig, what: str, warn) -> None:
    """Refuse a column the format reads that is null or empty in every row, or that holds no text
    (numbers, records), naming the column and the count; `warn` gets the count when only some
    rows are empty (those rows train on nothing, or on an empty response). Read a chunk of rows at
    a time (scan.py): a column read whole would be a copy of the corpus."""
    import pyarrow as pa

    from shardtune.data.scan import ArrowChunks

    for column, key, may_be_empty in read_columns(cfg):
        if column not in docs.column_names or len(docs) == 0:
            continue  # check_columns names a missing column
        kind = docs.data.schema.field(column).type
        texts = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        lists = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        wants = "lists of {role, content} messages" if cfg.format == "chat" else "text (or lists of text)"
        if pa.types.is_null(kind):
            empty = len(docs)
        elif (cfg.format != "chat" and texts) or (lists and (cfg.format == "chat" or pa.types.is_string(
                kind.value_type) or pa.types.is_large_string(kind.value_type))):
            messages = cfg.format == "chat" and lists and pa.types.is_struct(kind.value_type)
            empty = first = 0
            for chunk in ArrowChunks(docs, [column]):
                cells = chunk.column(column)
                empty += _empty_cells(cells, texts)
                if messages:
                    check_message_contents(cells, f"column {column!r} of {what} ({key})", first)
                first += len(cells)
        elif getattr(kind, "extension_name", None) == "arrow.json" and cfg.format != "chat":
            # `datasets` holds a JSON column whose values mix kinds (text here, 5 or {...} there) as JSON
            # text; a split whose own values are all text tokenizes (another split may hold the others)
            if (odd := _first_not_text(docs, column)) is not None:
                raise UserError(f"column {column!r} of {what} ({key}) mixes text with other values (one row holds "
                                f"{odd}); make those rows text (or lists of text), or use data.template to "
                                "format the columns")
            continue
        else:
            raise UserError(f"column {column!r} of {what} ({key}) holds {kind}, not {wants}; point {key} at the "
                            "right column, or use data.template to format other columns")
        if may_be_empty:
            continue
        if empty == len(docs):
            raise UserError(f"column {column!r} of {what} ({key}) is null or empty in all {empty} rows; point "
                            f"{key} at the column that holds the {'messages' if cfg.format == 'chat' else 'text'}")
        if empty:
            warn(f"warning: column {column!r} of {what} ({key}) is null or empty in {empty} of {len(docs)} rows")


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


def fill(template: str, row: dict, sep: str = " ") -> str:
    try:
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
        check_columns([cfg.text_field], docs.column_names, what, "data.text_field")
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


def _leading_bos(tokenizer) -> list[int]:
    """[bos] if this tokenizer puts BOS before text by itself (llama-style), else []. Done by
    hand so that a tokenizer that also appends EOS does not end the prompt with one."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if bos is not None and ids and ids[0] == bos and len(ids) > 1 else []


def instruct_prompt(cfg: DataConfig, row: dict) -> str:
    """The prompt part of one instruct row: data.template over its columns, else the alpaca layout
    (with the input section only where the row has a non-empty input)."""
    sep = cfg.list_sep
    if cfg.template is not None:
        return str(fill(cfg.template, row, sep))
    text_in = str(as_text(row.get(cfg.input_field), sep)).strip()
    base = PROMPT_WITH_INPUT if text_in else PROMPT_NO_INPUT
    return base.format(instruction=str(as_text(row[cfg.instruction_field], sep)).strip(), input=text_in)


def instruct_prompt_ids(cfg: DataConfig, tokenizer, row: dict) -> list[int]:
    """The prompt's token ids exactly as training saw them (a llama-style BOS included)."""
    return _leading_bos(tokenizer) + tokenizer(instruct_prompt(cfg, row), add_special_tokens=False)["input_ids"]


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
                            f"{', '.join(columns)}; set {key} to the right column")
    bos, eos = _leading_bos(tokenizer), tokenizer.eos_token_id
    cutoff, sep = cfg.example_cutoff, cfg.list_sep

    def build(batch):
        rows = _rows(batch)
        prompts = tokenizer([instruct_prompt(cfg, r) for r in rows], add_special_tokens=False)["input_ids"]
        answers = tokenizer([str(as_text(r[cfg.output_field], sep)) for r in rows],
                            add_special_tokens=False)["input_ids"]
        out = {"input_ids": [], "labels": [], "length": []}
        for p, a in zip(prompts, answers):
            p, a = bos + p, a + [eos]
            ids = (p + a)[:cutoff]
            labels = ids if cfg.train_on_inputs else ([IGNORE_INDEX] * len(p) + a)[:cutoff]
            _add_example(out, ids, labels)
        return out

    return build


def _add_example(out: dict, ids: list, labels) -> None:
    """One tokenized example into a batch of `datasets.map` columns."""
    out["input_ids"].append(ids)
    out["labels"].append(list(labels))
    out["length"].append(len(ids))


# ----------------------------------------------------------------------------- chat


def check_chat_template(cfg: DataConfig, tokenizer) -> None:
    """Install data.chat_template on the tokenizer (so final/ ships the template it was trained
    with), or fail if there is none at all."""
    if cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("data.format=chat but the tokenizer has no chat template; use a chat model's "
                        "tokenizer, set data.chat_template=<jinja template>, or use data.format=instruct")


def assistant_spans(messages: list[dict], render) -> tuple[str, list[tuple[int, int]]]:
    """(full text, character spans that get loss). A span runs from the end of the generation
    prompt before an assistant turn to the end of that turn as the template renders it, found
    by rendering prefixes; templates whose prefixes are not stable (some rewrite earlier turns)
    fall back to finding the message content itself."""
    full = render(messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render(messages[:i], True) if i else _opening(m, render)
            through = render(messages[:i + 1], False)
            start, end = len(before), len(through)
            stable = full.startswith(through) and full.startswith(before) and cursor <= start < end
        except Exception:  # e.g. a template that refuses a conversation ending on a user turn
            stable = False
        if not stable:
            content = m.get("content")
            start = full.find(content, cursor) if isinstance(content, str) and content else -1
            if start < 0:
                raise UserError("the chat template does not render assistant messages verbatim, so their "
                                "tokens cannot be found; set data.chat_template to a simpler template")
            end = start + len(content)
        end = start + len(full[start:end].rstrip())  # the newline after an end-of-turn token is not generated
        spans.append((start, end))
        cursor = end
    return full, spans


def _opening(message: dict, render) -> str:
    """What a conversation that opens with this assistant turn renders before the turn's content:
    templates render no empty conversation to take the generation prompt from, so it is what the
    turn shares with itself left empty (cut back to where its content starts, should the content
    begin with what the template puts after it)."""
    import os

    text, content = render([message], False), message["content"]
    shared = len(os.path.commonprefix([text, render([{**message, "content": ""}], False)]))
    at = text.rfind(content, 0, shared + len(content)) if content else -1
    return text[:at if 0 <= at < shared else shared]


def _label_spans(text: str, spans, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of `text` and labels that keep only tokens overlapping a span (a token like
    " an" that starts just before the reply is still one the model has to generate)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        inside = [any(a < e and max(b, a + 1) > s for s, e in spans) for a, b in enc["offset_mapping"]]
        return ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, inside)]
    # Slow tokenizers have no offsets: tokenize the pieces between span edges separately.
    edges = sorted({0, len(text), *(x for span in spans for x in span)})
    ids, labels = [], []
    for a, b in zip(edges, edges[1:]):
        part = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        keep = any(s <= a < e for s, e in spans)
        ids += part
        labels += part if keep else [IGNORE_INDEX] * len(part)
    return ids, labels


def chat_prompt_and_reply(tokenizer, value, index: int, field: str) -> tuple[str, str] | None:
    """(the conversation up to its last assistant turn, rendered with the generation prompt; that
    turn's content), or None when the row has no assistant turn after another turn."""
    messages = read_messages(value, index, field)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if not last:  # no assistant turn, or only an opening one: nothing before it to prompt with
        return None
    try:
        prompt = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja errors raised by the template itself
        raise UserError(f"the chat template failed on row {index} ({first_line(exc, 160)}); fix the row "
                        "or set data.chat_template") from None
    return prompt, str(as_text(messages[last].get("content")))


def any_assistant_turn(docs, cfg: DataConfig) -> bool:
    """Whether some conversation of `docs` has an assistant turn: when none keeps a loss token, a
    longer cutoff helps only if one does. Read a chunk of rows at a time, up to the first one."""
    from shardtune.data.scan import ArrowChunks

    field, first = cfg.messages_field, 0
    for chunk in ArrowChunks(docs, [field]):
        values = chunk.column(field).to_pylist()
        if any(m["role"] == "assistant" for i, v in enumerate(values, first) for m in read_messages(v, i, field)):
            return True
        first += len(values)
    return False


def chat_fn(cfg: DataConfig, tokenizer, columns: list[str], what: str):
    """Batched map function (with_indices): rows -> {input_ids, labels, length}."""
    field = cfg.messages_field
    if field not in columns:
        raise UserError(f"data.format=chat needs a column {field!r} of messages but {what} has only: "
                        f"{', '.join(columns)}; set data.messages_field")
    check_chat_template(cfg, tokenizer)
    cutoff = cfg.example_cutoff

    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def build(batch, indices):
        out = {"input_ids": [], "labels": [], "length": []}
        for value, index in zip(batch[field], indices):
            messages = read_messages(value, index, field)
            try:
                text, spans = assistant_spans(messages, render)
            except UserError:
                raise
            except Exception as exc:  # jinja errors raised by the template itself
                raise UserError(f"the chat template failed on row {index} ({first_line(exc, 160)}); fix the row "
                                "or set data.chat_template") from None
            ids, labels = _label_spans(text, spans, tokenizer)
            ids, labels = ids[:cutoff], (ids if cfg.train_on_inputs else labels)[:cutoff]
            _add_example(out, ids, labels)
        return out

    return build
