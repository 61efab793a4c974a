"""How rows become text, tokens and labels at their edges: a data.template's fields over list and
record cells (indexing the cell, not its joined text), fields that are not data, and a chat
conversation's labels whatever its turns (an assistant turn first, same-role turns, tools)."""

from __future__ import annotations

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import formats as F
from shardtune.errors import UserError

IGNORE = F.IGNORE_INDEX
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
