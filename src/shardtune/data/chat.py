"""Chat conversations as tokens and labels: the run's chat template renders each conversation,
and the loss falls on the assistant turns only (each reply and its end of turn), found where the
template puts them; `eval --generate` takes its prompts and references from the same rendering."""

from __future__ import annotations

import os

from shardtune.config.schema import DataConfig
from shardtune.data.formats import IGNORE_INDEX, add_example, format_hint, new_examples
from shardtune.data.messages import read_messages
from shardtune.errors import UserError, first_line


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
    fall back to finding the message content itself (`_found`)."""
    full = render(messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = through = None
        try:
            before = render(messages[:i], True) if i else _opening(m, render)
            through = render(messages[:i + 1], False)
        except Exception:  # e.g. a template that refuses a conversation ending on a user turn
            pass
        if before is not None and through is not None and full.startswith(through) and full.startswith(before) \
                and cursor <= len(before) < len(through):
            start, end = len(before), len(through)
        else:
            start, end = _found(full, messages, i, render, before, cursor)
        end = start + len(full[start:end].rstrip())  # the newline after an end-of-turn token is not generated
        spans.append((start, end))
        cursor = end
    return full, spans


# private-use characters: in no message, and kept as they are by any template that does not rewrite content
MARK = "\ue000turn\ue000"
NOT_VERBATIM = ("the chat template does not render assistant messages verbatim, so their tokens cannot be found; "
                "set data.chat_template to a simpler template")


def _found(full: str, messages: list[dict], i: int, render, before: str | None, cursor: int) -> tuple[int, int]:
    """(start, end) in `full` of assistant turn i where the template renders it otherwise in the
    whole conversation (Qwen3's marks only the last turn): where the template puts its content (the
    conversation rendered with a mark for it), else the content searched after what `full` shares
    with the turns before it (a system or user message, or the turn's header, may hold the same
    words); through the end of turn that follows the content when the turn is rendered last
    (<|im_end|>), as far as `full` has it there too."""
    content = messages[i].get("content")
    if not isinstance(content, str) or not content:
        raise UserError(NOT_VERBATIM)
    turn = {**messages[i], "content": MARK}
    try:
        marked, last = render([*messages[:i], turn, *messages[i + 1:]], False), render([*messages[:i], turn], False)
    except Exception:
        marked = last = ""
    start = marked.find(MARK)
    if not (cursor <= start and full.startswith(marked[:start]) and full.startswith(content, start)
            and full[start + len(content):] == marked[start + len(MARK):]):
        after = max(cursor, len(os.path.commonprefix([before, full]))) if before is not None else cursor
        start = full.find(content, after)
        if start < 0:
            raise UserError(NOT_VERBATIM)
    end = start + len(content)
    # the turn's end as the template closes it when last, to a whitespace, as far as `full` has it too: a
    # conversation's end may add more (Phi-3's: <|end|>\n then EOS, where a next turn follows <|end|>\n)
    tail = last[last.find(MARK) + len(MARK):] if MARK in last else ""
    ends = (tail[:k].rstrip() for k in range(len(tail), 0, -1) if k == len(tail) or tail[k].isspace())
    return start, end + len(next((c for c in ends if full.startswith(c, end)), ""))


def _opening(message: dict, render) -> str:
    """What a conversation that opens with this assistant turn renders before the turn's content:
    templates render no empty conversation to take the generation prompt from, so it is what the
    turn renders before a mark in its content's place. What the turn shares with itself left empty
    overshot where the content is not rendered as it is (trimmed: Llama-3's, Gemma's) or is empty
    (it took the turn's end too, and the turn was refused); it is the fallback for a template
    that changes the mark (cut back to where its content starts, should the content begin with
    what the template puts after it)."""
    text, content = render([message], False), message["content"]
    marked = render([{**message, "content": MARK}], False)
    if (mark := marked.find(MARK)) >= 0 and text.startswith(marked[:mark]):
        return marked[:mark]
    shared = len(os.path.commonprefix([text, render([{**message, "content": ""}], False)]))
    at = text.rfind(content, 0, shared + len(content)) if content else -1
    return text[:at if 0 <= at < shared else shared]


def reply_ids(tokenizer, prompt: str, reply: str) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of `prompt + reply` tokenized together and split where training's
    labels start (`_label_spans`): tokenized alone, a SentencePiece reply gained a leading space."""
    ids, labels = _label_spans(prompt + reply, [(len(prompt), len(prompt) + len(reply))], tokenizer)
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(ids))
    return ids[:first], ids[first:]


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


def chat_prompt(tokenizer, messages: list[dict], index: int) -> str:
    """`messages` rendered with the generation prompt after them (row `index`'s, for a refusal)."""
    return _rendered(lambda: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), index)


def chat_prompt_and_reply(tokenizer, value, index: int, field: str) -> tuple[str, str] | None:
    """(the conversation up to its last assistant turn, rendered with the generation prompt; that
    turn as training labels it, its end of turn included: what the template writes after the
    generation prompt, Qwen3's empty <think></think> before the content, Llama-3's content trimmed),
    or None when the row has no assistant turn after another turn."""
    messages = read_messages(value, index, field)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if not last:  # no assistant turn, or only an opening one: nothing before it to prompt with
        return None

    def render(turns, generation_prompt):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    full, spans = _rendered(lambda: assistant_spans(messages[:last + 1], render), index)
    return chat_prompt(tokenizer, messages[:last], index), full[spans[-1][0]:spans[-1][1]]


def _rendered(render, index: int):
    try:
        return render()
    except UserError:
        raise
    except Exception as exc:  # jinja errors raised by the template itself
        raise UserError(f"the chat template failed on row {index} ({first_line(exc, 160)}); fix the row "
                        "or set data.chat_template") from None


def _turn_tail(tokenizer, template: str | None) -> str | None:
    """What the chat template renders after an assistant reply that ends the conversation, or None
    where it refuses a user turn and a reply (training's check names it)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}],
                                             chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001
        return None
    return text[text.find(MARK) + len(MARK):] if MARK in text else None


def turn_end(tokenizer, template: str | None = None) -> int | str | None:
    """What the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>,
    <end_of_turn>): its token id, or its text where that is several tokens (a template given as
    data.chat_template to a tokenizer without its special tokens). Training labels it as the end of
    every reply, so generation stops there; the tokenizer's EOS is often another token (a base
    model's <|endoftext|> under ChatML), and generation went on into turns of its own. None where
    the turn ends in whitespace only. `template`: another than the tokenizer's own."""
    tail = (_turn_tail(tokenizer, template) or "").split()
    if not tail:
        return None
    ids = tokenizer(tail[0], add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else tail[0]


def unended_turns(cfg: DataConfig, tokenizer) -> str | None:
    """A warning where the run's chat template ends an assistant turn with whitespace only: no token
    after a reply has a loss (the tokenizer's EOS is in no conversation), so the model never learns
    to end one and generation runs on to its token limit."""
    tail = _turn_tail(tokenizer, cfg.chat_template)
    if tail is None or tail.strip():
        return None
    return ("warning: the chat template ends an assistant turn with no token (only whitespace after the reply), so "
            "no reply is trained to end and generation runs on to its token limit; end the turn with a token in "
            "data.chat_template (e.g. {{ eos_token }} after the assistant's content)")


def trained_ends(cfg: DataConfig, tokenizer) -> list[int | str]:
    """What ends an answer as training taught it to end: the tokenizer's EOS (after each instruct
    response and text document), and in the chat format the template's end of turn (`turn_end`: a
    token id, or a text of several tokens). generate stops at these; final/ and checkpoints add the
    ids to their generation config's EOS, so other tools' generate stops there too."""
    out = [tokenizer.eos_token_id]
    # the run's template where it set one (a --compare base may have none of its own)
    if cfg.format == "chat" and (cfg.chat_template or getattr(tokenizer, "chat_template", None)):
        out.append(turn_end(tokenizer, cfg.chat_template))
    return list(dict.fromkeys(s for s in out if s is not None))


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
                        f"{', '.join(columns)}; set data.messages_field{format_hint(cfg, columns)}")
    check_chat_template(cfg, tokenizer)
    cutoff = cfg.example_cutoff

    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def build(batch, indices):
        out = new_examples()
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
            add_example(out, ids, ids if cfg.train_on_inputs else labels, cutoff)
        return out

    return build
