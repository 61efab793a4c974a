"""`generate`'s prompt layouts (evaluation/prompts.py): a chat run's user turn with the
generation prompt, an instruct run's template, and what a single prompt cannot fill."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.config.schema import DataConfig
from shardtune.errors import UserError
from shardtune.evaluation.prompts import layout, rendered


@pytest.fixture
def tok(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


def test_a_chat_prompt_is_a_user_turn_before_the_generation_prompt(tok):
    [(text, ids)] = rendered(["2+2?"], DataConfig(format="chat"), tok)
    assert text == "<user>2+2?\n<assistant>" and ids == tok(text, add_special_tokens=False)["input_ids"]


def test_a_text_prompt_starts_as_training_documents_do(tok):
    """A llama-style tokenizer's BOS before a text prompt (every training document had it), and
    nothing before one of a tokenizer that puts none."""
    from conftest import llama_tokenizer

    llama = llama_tokenizer(add_eos=True)
    assert rendered(["hello"], DataConfig(), llama) == [("hello", llama("hello")["input_ids"][:-1])]
    assert rendered(["hello"], DataConfig(), tok) == [("hello", tok("hello")["input_ids"])]


def test_an_instruct_prompt_is_the_instruction(tok):
    from shardtune.data.formats import PROMPT_NO_INPUT

    [(text, _)] = rendered(["Say hi."], DataConfig(format="instruct"), tok)
    assert text == PROMPT_NO_INPUT.format(instruction="Say hi.")
    own = DataConfig(format="instruct", template="Task: {task}", instruction_field="task")
    [(text, _)] = rendered(["Say hi."], own, tok)
    assert text == "Task: Say hi."
    with pytest.raises(UserError, match="fills columns a prompt cannot give.*--format text"):
        rendered(["x"], DataConfig(format="instruct", template="{quote} by {author}"), tok)


def test_the_layout_is_the_runs_unless_format_says_otherwise():
    from types import SimpleNamespace

    run = SimpleNamespace(data=DataConfig(format="chat", chat_template="{{ x }}"))
    assert layout(None, None).format == "text" and layout("instruct", None).format == "instruct"
    assert layout(None, run).chat_template == "{{ x }}" and layout("chat", run).chat_template == "{{ x }}"
    assert layout("text", run) == DataConfig(format="text")


def test_chat_without_a_template_names_the_format_option(tok):
    tok.chat_template = None
    with pytest.raises(UserError, match="^--format chat lays .* choose --format instruct or text$"):
        rendered(["hi"], DataConfig(format="chat"), tok)
    [(text, _)] = rendered(["hi"], DataConfig(format="chat", chat_template="[{{ messages[0].content }}]"), tok)
    assert text == "[hi]"  # the run's own template (data.chat_template) is used where the tokenizer has none


def test_another_format_of_the_runs_data_keeps_its_held_out_split():
    """eval RUN --format F (F not the run's) reads the run's documents and validation split, not
    the defaults' (a 5 % carve of the whole file)."""
    from types import SimpleNamespace

    from shardtune.evaluation.evaluate import RUN_DATA, data_config

    data = DataConfig(path="d.jsonl", format="instruct", val_size=3, start_idx=2, end_idx=40, seq_len=64,
                      template="Q: {instruction}")
    run = SimpleNamespace(data=data)
    req = SimpleNamespace(model="run", data=None, data_name=None, text_field="output", format="text")
    cfg = data_config(req, run)
    assert cfg.format == "text" and cfg.template is None and cfg.text_field == "output"
    assert all(getattr(cfg, key) == getattr(data, key) for key in RUN_DATA)


def test_a_prompts_file_saved_with_a_bom_gives_its_prompts_without_it(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark: it is no part of the first prompt."""
    from shardtune.evaluation.evaluate import GenerateRequest, read_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffOnce upon\r\na time\r\n".encode())
    assert read_prompts(GenerateRequest(model="m", prompts_file=str(path))) == ["Once upon", "a time"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\r\n")),
                max_size=6), st.sampled_from(["\n", "\r\n", "\r"]))
def test_a_prompts_file_gives_one_prompt_per_line(tmp_path_factory, lines, end):
    """Each non-blank line is one prompt, whatever it holds: a form feed, U+2028 or U+0085 inside a
    line cut it into two prompts (str.splitlines), numbering every later prompt wrong."""
    from shardtune.evaluation.evaluate import GenerateRequest, read_prompts

    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_bytes(end.join(lines).encode())
    want = [line for line in lines if line.strip()]
    if want:
        assert read_prompts(GenerateRequest(model="m", prompts_file=str(path))) == want
