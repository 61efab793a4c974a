"""Chat messages (data/messages.py): every message's role and content are text, or OpenAI's text
parts, which read as their text; anything else is one line naming the row and the message, never
a chat template's rendering of it (`5`, a Python list's repr) trained on without a word."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtune.config.schema import DataConfig
from shardtune.data import chat
from shardtune.data import pipeline as D
from shardtune.data.messages import read_messages
from shardtune.errors import UserError

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    tok.chat_template = TEMPLATE
    return tok


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def conversation(user, reply) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def tokenize(tmp_path, rows: list[dict], tokenizer, **kw):
    """rows written as jsonl and read as training reads them (arrow's types, mixed ones as JSON)."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), format="chat", seq_len=256, **kw)
    docs = D.load_documents(cfg)["train"]
    return D.tokenize_split(docs, cfg, tokenizer, "chat.jsonl", warn=lambda line: None, required=True)


def test_text_parts_train_as_their_text(tmp_path, chat_tokenizer):
    """OpenAI's content parts (user turns as parts, replies as text: one column of mixed kinds)
    tokenize as the same conversation with text content, not as the repr of a list."""
    with_parts = [conversation(parts("what is ", "two plus two?"), "four") for _ in range(3)]
    plain = [conversation("what is two plus two?", "four") for _ in range(3)]
    got = tokenize(tmp_path, with_parts, chat_tokenizer)
    assert got["input_ids"] == tokenize(tmp_path, plain, chat_tokenizer)["input_ids"]
    assert "type" not in chat_tokenizer.decode(got["input_ids"][0])


@pytest.mark.parametrize("content, words", [
    (5, ["message 0 of row 2", "has content '5' (int), not text"]),
    ({"text": "hi"}, ["has content", "(dict), not text"]),
    ([{"type": "image_url", "image_url": {"url": "x.png"}}], ["content part of type 'image_url'", "only text parts"]),
])
def test_content_that_is_not_text_is_refused(tmp_path, chat_tokenizer, content, words):
    """In a column of text content (a value of another kind makes it JSON) or alone in its column."""
    mixed = [conversation("hi", "hello")] * 2 + [conversation(content, "hello")]
    for rows in (mixed, [conversation(content, "x")] * 3):
        with pytest.raises(UserError) as exc:
            tokenize(tmp_path, rows, chat_tokenizer)
        assert "\n" not in str(exc.value) and "message 0 of row" in str(exc.value)
        assert all(w in str(exc.value) for w in words[1:]), str(exc.value)


@pytest.mark.parametrize("role", [1, None])
def test_a_role_that_is_not_text_is_refused(tmp_path, chat_tokenizer, role):
    rows = [{"messages": [{"role": role, "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    with pytest.raises(UserError, match="message 0 of row 0 .* has role .*not text"):
        tokenize(tmp_path, rows, chat_tokenizer)


def test_conversations_without_an_assistant_turn_say_so(tmp_path, chat_tokenizer):
    """Not "raise data.seq_len": no cutoff would give them a loss token."""
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}] * 3
    with pytest.raises(UserError, match="no conversation of chat.jsonl has an assistant turn"):
        tokenize(tmp_path, rows, chat_tokenizer)
    long = [conversation("hi", "a long reply " * 100)] * 3  # cut off: the cutoff is the fix
    with pytest.raises(UserError, match="raise data.cutoff_len"):
        tokenize(tmp_path, long, chat_tokenizer, cutoff_len=4)


def test_chat_prompts_read_text_parts(chat_tokenizer):
    """eval --generate's prompts and references go through the same messages."""
    prompt, reply = chat.chat_prompt_and_reply(chat_tokenizer, conversation(parts("a", "b"), parts("c"))["messages"], 0,
                                            "messages")
    assert prompt == "<|user|>\nab<|endoftext|>\n<|assistant|>\n" and reply == "c<|endoftext|>"  # as trained


CONTENTS = st.one_of(st.text(max_size=5), st.integers(), st.floats(allow_nan=False), st.booleans(),
                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                     "text": st.one_of(st.text(max_size=3), st.integers())}),
                              max_size=3),
                     st.dictionaries(st.sampled_from(["text", "x"]), st.text(max_size=3), max_size=2))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(CONTENTS, min_size=1, max_size=4), roles=st.lists(st.one_of(st.just("user"), st.integers()),
                                                                           min_size=4, max_size=4))
def test_messages_are_text_or_refused_in_one_line(contents, roles):
    """Whatever a message holds: read as text (its own, or its text parts joined), or refused in
    one line naming the message; never passed on as something else."""
    value = [{"role": r, "content": c} for r, c in zip(roles[:len(contents)], contents, strict=True)]
    try:
        got = read_messages(value, 7, "messages")
    except UserError as exc:
        assert "\n" not in str(exc) and "of row 7 of data.messages_field='messages'" in str(exc), str(exc)
        return
    for m, c in zip(got, contents, strict=True):
        assert isinstance(m["role"], str) and m["content"] == (c if isinstance(c, str) else "".join(
            p["text"] for p in c))
