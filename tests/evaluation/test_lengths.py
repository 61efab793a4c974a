"""evaluation/lengths.py: eval's and generate's lengths against the positions of the models."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from shardtune.errors import UserError
from shardtune.evaluation import lengths
from shardtune.evaluation.lengths import Room

ROOMS = st.one_of(st.none(), st.builds(Room, st.integers(2, 700), st.just("m"), st.integers(0, 30)))
GIVEN = st.one_of(st.none(), st.integers(1, 800))


def named_options(line: str) -> set[str]:
    return set(re.findall(r"--[a-z-]+", line))


@given(room=ROOMS, prompt=GIVEN, new=GIVEN)
def test_text_prompts_and_new_tokens_fit_or_name_only_the_options_given(room, prompt, new):
    """A default never makes the command fail (it is cut to what fits); a refusal names only the
    options the user gave, with a value that fits; what is returned fits in the room."""
    try:
        got_prompt, got_new = lengths.prompt_and_new_tokens(prompt, new, room)
    except UserError as exc:
        line = str(exc)
        assert "\n" not in line and room is not None and "data.seq_len" not in line
        assert named_options(line) <= {o for o, v in (("--prompt-tokens", prompt), ("--max-new-tokens", new)) if v}
        assert named_options(line), line
        return
    assert (prompt is None or got_prompt == prompt) and (new is None or got_new == new)
    assert got_prompt >= 1 and got_new >= 1
    assert (prompt is not None or got_prompt <= lengths.PROMPT_TOKENS) and (new is not None or
                                                                           got_new <= lengths.NEW_TOKENS)
    if room is not None:
        assert got_prompt + got_new <= room.tokens


@given(room=ROOMS, new=GIVEN, longest=st.integers(1, 900))
def test_new_tokens_fit_or_name_the_option_given(room, new, longest):
    try:
        got = lengths.new_tokens(new, room, longest)
    except UserError as exc:
        assert new is not None and named_options(str(exc)) == {"--max-new-tokens"}, str(exc)
        assert f"--max-new-tokens {room.tokens - 1} or less" in str(exc)
        return
    assert got == new if new is not None else 1 <= got <= lengths.NEW_TOKENS
    assert room is None or got < room.tokens


@given(room=ROOMS, seq_len=st.one_of(st.none(), st.integers(2, 800)), run=st.one_of(st.none(), st.integers(2, 800)))
def test_eval_seq_len_fits_or_names_seq_len(room, seq_len, run):
    """eval has no data.seq_len option: a refusal names --seq-len (the run's value as the run's)."""
    try:
        got = lengths.seq_len(seq_len, run, room)
    except UserError as exc:
        line = str(exc)
        assert f"--seq-len {room.tokens} or less" in line and (seq_len is not None or "the run's data.seq_len" in line)
        return
    assert got == (seq_len or run or got) and (room is None or got <= room.tokens)
    assert seq_len or run or got == min(lengths.SEQ_LEN, room.tokens if room else lengths.SEQ_LEN)
