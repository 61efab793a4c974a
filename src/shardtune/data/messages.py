"""Chat messages as the chat format reads them: OpenAI's {role, content} or ShareGPT's {from,
value}, each message's content text, or a list of OpenAI's text parts ({type: text, text}),
joined. Anything else in a message (a number, a record, an image part, a null) is refused with
the row and the message: a chat template renders whatever it is given as text (`5`, a Python
list's repr, `None`) and the run would train on that without a word."""

from __future__ import annotations

from shardtune.errors import UserError

# ShareGPT's messages, {from, value} with its own role names, as most chat datasets not in OpenAI's
# {role, content} are (and the layout axolotl and LLaMA-Factory read): taken as the same messages
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # system, user, assistant, tool: the same names
FIX = "make each message's content text (or a list of {type: text, text} parts), or drop the row"


def content_key(keys) -> str | None:
    """The key holding a message's text in messages with these keys: content, ShareGPT's value, or None."""
    return "content" if "content" in keys else "value" if {"from", "value"} <= set(keys) else None


def check_message_contents(cells, what: str, first_row: int = 0) -> None:
    """Chat messages without text: a template renders a null content as the text "None" (or
    nothing) and trains on it without a word, so every message must hold its content. `cells`
    are rows `first_row`, ... of the data (a chunk of them)."""
    import pyarrow.compute as pc

    struct = cells.type.value_type
    names = [struct.field(i).name for i in range(struct.num_fields)]
    key = content_key(names)
    if key is None:
        raise UserError(f"the messages of {what} have no 'content' field (fields: {', '.join(names)}); give "
                        "{role, content} messages, or ShareGPT's {from, value}")
    content = pc.struct_field(pc.list_flatten(cells), key)
    if content.null_count:
        row = first_row + pc.list_parent_indices(cells).filter(pc.is_null(content))[0].as_py()
        raise UserError(f"message(s) in {what} have no content (null), the first in row {row} ({content.null_count} "
                        f"in rows {first_row}-{first_row + len(cells) - 1}); fix or drop those rows (a chat "
                        "template would train on its rendering of null)")


def read_messages(value, index: int, field: str) -> list[dict]:
    """Messages of one row, checked, as {role, content} with text content (ShareGPT's {from, value}
    renamed, text parts joined); keys that arrow filled with None for other rows dropped."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and m.get("role") is None
                                                 and content_key(m) == "value" for m in value):
        value = [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in value]
    ok = isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and m.get("content")
                                                   is not None for m in value)
    if not ok:
        raise UserError(f"row {index} of data.messages_field={field!r} is not a list of {{role, content}} "
                        f"(or ShareGPT {{from, value}}) messages (got {str(value)[:80]!r}); fix the data or set "
                        "data.messages_field")
    out = []
    for number, m in enumerate(value):
        m = {k: v for k, v in m.items() if v is not None}
        where = f"message {number} of row {index} of data.messages_field={field!r}"
        if not isinstance(m.get("role"), str):
            raise UserError(f"{where} has role {_shown(m.get('role'))}, not text; give every message a role "
                            "(system, user, assistant, ...) or drop the row")
        out.append({**m, "content": _text(m["content"], where)})
    return out


def _text(content, where: str) -> str:
    """A message's content as text: itself, or its text parts joined (as chat templates that take
    parts render them: one after the other)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        odd = next((p for p in content if p.get("type") != "text" or not isinstance(p.get("text"), str)), None)
        if odd is None:
            return "".join(p["text"] for p in content)
        kind = odd.get("type")
        raise UserError(f"{where} has a content part of type {kind!r} (only text parts are read: "
                        f"{{type: text, text: ...}}); {FIX}" if kind != "text" else
                        f"{where} has a text part whose text is {_shown(odd.get('text'))}; {FIX}")
    raise UserError(f"{where} has content {_shown(content)}, not text; {FIX}")


def _shown(value) -> str:
    """A value for a refusal: short, with its kind."""
    return f"{str(value)[:40]!r} ({type(value).__name__})" if value is not None else "null"
