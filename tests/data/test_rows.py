"""How rows become text, tokens and labels at their edges: a data.template's fields over list and
record cells (indexing the cell, not its joined text), fields that are not data, and a chat
conversation's labels whatever its turns (an assistant turn first, same-role turns, tools) and
whatever its template renders otherwise when a turn is the last."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtune.config.schema import DataConfig
from shardtune.data import chat
from shardtune.data import formats as F
from shardtune.errors import UserError

IGNORE = F.IGNORE_INDEX
# ChatML-like, as test_formats.py's; <|endoftext|> is the quickstart tokenizer's EOS (the end of a turn)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# one that changes the content as it renders it, so no message is found verbatim
SHOUTING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
# amazingvince/lc0-test80-games' list column, with a record column of the game's players
GAMES = [{"moves": ["e4", "e5", "Nf3"], "players": {"white": "Carlsen", "black": None}},
         {"moves": ["d4"], "players": {"white": "Anand", "black": "Gelfand"}}]


def dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["tokenizer"])


def rendered(template: str, rows=GAMES) -> list[str]:
    docs, field = F.render_text(dataset(rows), DataConfig(path="x", template=template), "games")
    return docs[field]


# ----------------------------------------------------------------------------- templates


def test_template_fields_index_the_cells_not_their_text():
    # {moves[0]} is the first move (not the first letter of "e4 e5 Nf3"), a record's null field is
    # empty (not "None"), and the value a field ends on is joined as a whole column is
    assert rendered("{moves[0]}|{players[white]} v {players[black]}") == ["e4|Carlsen v ", "d4|Anand v Gelfand"]
    assert rendered("{moves}: {moves!r}") == ["e4 e5 Nf3: 'e4 e5 Nf3'", "d4: 'd4'"]


@pytest.mark.parametrize("template, words", [
    ("{players}", ["{players} holds records (fields white, black)", "{players[white]}"]),
    ("{moves[0].upper}", ["{moves[0].upper} is a method of the column's str values"]),
])
def test_template_fields_that_render_no_data_are_refused(template, words):
    with pytest.raises(UserError) as err:
        rendered(template)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_a_list_text_field_is_no_template(tokenizer):
    """A list column named like a template's attribute access is read as the column."""
    rows = [{"game.moves": g["moves"]} for g in GAMES]
    docs, field = F.render_text(dataset(rows), DataConfig(path="x", text_field="game.moves"), "games")
    assert docs[field] == ["e4 e5 Nf3", "d4"]


# ----------------------------------------------------------------------------- chat labels


def labelled(tokenizer, messages: list[dict], template: str = CHAT_TEMPLATE) -> tuple[str, str]:
    """(the row's text, the text of its tokens with a label) as chat training builds them."""
    tokenizer.chat_template = None
    ds = dataset([{"messages": messages}])
    cfg = DataConfig(path="x", format="chat", chat_template=template, seq_len=2048)
    row = ds.map(chat.chat_fn(cfg, tokenizer, ds.column_names, "chats"), batched=True, with_indices=True,
                 remove_columns=ds.column_names)[0]
    return tokenizer.decode(row["input_ids"]), tokenizer.decode([t for t in row["labels"] if t != IGNORE])


TURNS = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]),
                           st.from_regex(r"[a-z][a-z .?]{0,12}", fullmatch=True)), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=TURNS)
def test_chat_labels_are_every_assistant_reply_and_its_end_of_turn(tokenizer, turns):
    """Whatever the order of the turns (an assistant first, two in a row, tool results between):
    the labelled tokens are exactly each assistant content with the template's end of its turn."""
    messages = [{"role": r, "content": c} for r, c in turns]
    text, kept = labelled(tokenizer, messages)
    eos = tokenizer.eos_token
    assert text == tokenizer.apply_chat_template(messages, tokenize=False)
    assert kept == "".join(c + eos for r, c in turns if r == "assistant")


def test_an_opening_assistant_turn_of_a_template_that_changes_the_text(tokenizer):
    """No conversation before it renders a generation prompt, and its content is not in the text as
    written: its turn is still found (it was refused), with its end of turn."""
    messages = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "bye"}]
    text, kept = labelled(tokenizer, messages, SHOUTING)
    assert kept == "HELLO<|endoftext|>BYE<|endoftext|>", (text, kept)
    assert chat.chat_prompt_and_reply(tokenizer, messages[:1], 0, "messages") is None  # nothing to prompt with


# templates that render an assistant turn otherwise when it is the conversation's last, so every
# earlier one is found by its content: Qwen3's marks the turn (there an empty thinking block),
# Phi-3's ends the conversation with EOS where no generation prompt follows
MARKS_THE_LAST = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if loop.last and m['role'] == 'assistant' %}"
                  "(last) {% endif %}{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ENDS_THE_CONVERSATION = CHAT_TEMPLATE.replace("{% endif %}", "{% else %}[end]{% endif %}")
WORDS = st.lists(st.sampled_from(["ok", "look", "a", "no"]), min_size=1, max_size=3).map(" ".join)


@pytest.mark.parametrize("template, opens, closes", [(MARKS_THE_LAST, "(last) ", ""),
                                                     (ENDS_THE_CONVERSATION, "", "\n[end]")])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(exchanges=st.lists(st.tuples(st.sampled_from(["system", "user"]), WORDS, st.none() | WORDS), min_size=1,
                          max_size=4))
def test_chat_turns_a_template_renders_otherwise_last_are_their_own_words_and_end_of_turn(tokenizer, template, opens,
                                                                                        closes, exchanges):
    """A turn found by its content is the assistant's words (not the same words in an earlier
    message or in the turn's header: `a` in `<|assistant|>`), with the end of its turn."""
    turns = [t for role, said, reply in exchanges
             for t in [(role, said)] + [("assistant", reply)] * (reply is not None)]
    text, kept = labelled(tokenizer, [{"role": r, "content": c} for r, c in turns], template)
    eos, last = tokenizer.eos_token, len(turns) - 1
    assert kept == "".join((opens + c + eos + closes) if i == last else c + eos for i, (r, c) in enumerate(turns)
                           if r == "assistant"), text

# templates that mark what the assistant generates ({% generation %}): transformers' own assistant mask
# is the reference. Llama-3's and Gemma's trim the content (not verbatim), Gemma's renames the role.
GENERATES = {
    "chatml": "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] }}<|endoftext|>{% endgeneration %}{% else %}{{ m['content'] }}<|endoftext|>{% endif %}"
              "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "llama3": "[begin]{% for m in messages %}[{{ m['role'] }}]\n\n{% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] | trim }}<|endoftext|>{% endgeneration %}{% else %}{{ m['content'] | trim }}"
              "<|endoftext|>{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]\n\n{% endif %}",
    "gemma": "[bos]{% for m in messages %}{% set r = 'model' if m['role'] == 'assistant' else m['role'] %}"
             "<turn>{{ r }}\n{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|endoftext|>"
             "{% endgeneration %}\n{% else %}{{ m['content'] | trim }}<|endoftext|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<turn>model\n{% endif %}",
}
# a special token's text in a message (the end of turn, a header) is read as the token, as transformers reads it,
# and moves no label: a user's text is never the assistant's
EDGES = st.lists(st.sampled_from(["hi", " hi", "hi ", "\n", "model", "<", "[end]", "a1.", " ", "x\n\n", "<|endoftext|>",
                                  "<|assistant|>\n", "\r\n"]), max_size=3).map("".join)


@pytest.mark.parametrize("template", GENERATES.values(), ids=GENERATES.keys())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), EDGES), min_size=1, max_size=4))
def test_chat_labels_are_the_tokens_transformers_marks_as_generated(tokenizer, template, turns):
    """Any conversation (an empty reply, one the template trims, an assistant turn first): the tokens
    with a loss are those transformers' assistant mask marks. An opening turn's start was taken
    from what it shares with itself left empty: a trimmed reply lost or gained its first characters,
    an empty one was refused."""
    messages = [{"role": r, "content": c} for r, c in turns]
    ds = dataset([{"messages": messages}])
    cfg = DataConfig(path="x", format="chat", chat_template=template, seq_len=2048)
    row = chat.chat_fn(cfg, tokenizer, ds.column_names, "chats")(ds[:], [0])
    tokenizer.chat_template = template
    try:
        ref = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    finally:
        tokenizer.chat_template = None
    assert row["input_ids"][0] == ref["input_ids"]
    assert [t != IGNORE for t in row["labels"][0]] == [bool(m) for m in ref["assistant_masks"]], messages


CELLS = st.one_of(st.none(), st.integers(-99, 99), st.text(max_size=6), st.lists(st.text(max_size=3), max_size=3),
                  st.lists(st.integers(0, 9), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(row=st.fixed_dictionaries({"a": CELLS, "b-c": CELLS}),
       spec=st.sampled_from(["", "!r", ":>6", "!s:^5", ":05d"]), other=st.sampled_from(["{a}", "{b-c}", "x"]))
def test_a_template_of_whole_cells_renders_as_the_cell_formatter_does(row, spec, other):
    """fill's fast path for templates that name whole cells (str.format_map over the cells made
    text) gives exactly what the cell formatter gives, or the same refusal."""
    template = f"<{{a{spec}}}|{other}>"

    def outcome(render):
        try:
            return render()
        except (UserError, ValueError, TypeError) as exc:
            return type(exc).__name__ if not isinstance(exc, UserError) else "refused"

    slow = outcome(lambda: F._Cells(" ").vformat(template, (), row))
    fast = outcome(lambda: F.fill(template, row))
    assert fast == slow or (fast == "refused" and slow in ("ValueError", "TypeError")), (template, row, fast, slow)
