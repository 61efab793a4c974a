"""A data key that the run's format does not read gets one warning line (config.validation.
unread_data_keys, said by check.run), and only such a key: for every format and every data key
that shapes the token rows, the rows change with the key's value exactly where no warning is given.
A new data key must say here what to try it with, or why it is checked elsewhere."""

from __future__ import annotations

import dataclasses

import pytest

from shardtune.config.schema import DataConfig
from shardtune.config.validation import unread_data_keys

CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
OTHER_CHAT = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }};{% endfor %}"
DIALOGUE = [{"role": "user", "content": "what is the longest river in the world, and how is its length measured?"},
            {"role": "assistant", "content": "the nile, or the amazon by some counts: where a river begins is "
                                             "a matter of choice, and the amazon's mouth is wide enough to be "
                                             "measured along more than one of its channels, so the answer "
                                             "depends on whom you ask."}]

# Another value for each key that shapes the token rows; every column the values name is in ROWS.
ANOTHER = {
    "text_field": "alt_text", "template": "{a} and then {b}", "list_sep": " | ",
    "instruction_field": "alt_instruction", "input_field": "alt_input", "output_field": "alt_output",
    "messages_field": "alt_messages", "chat_template": OTHER_CHAT, "train_on_inputs": True, "cutoff_len": 180,
    "packing": True, "document_mask": True,
}
# Keys that choose the data or the split, or act on batches (tests/data): not on a split's rows.
ELSEWHERE = {"path", "name", "split", "val_split", "val_size", "seq_len", "start_idx", "end_idx", "num_proc",
             "format", "group_by_length", "padding_free"}


def row(i: int) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    w = words[i % len(words)]
    return {"text": [f"the {w} document", "in two parts"], "alt_text": f"another {w} text entirely",
            "a": f"first {w}, a long cell: " + "the prompt goes on and on before any answer comes. " * 4,
            "b": ["second", "cell"],
            "instruction": f"spell {w} backwards please", "alt_instruction": f"count the letters of {w}",
            "input": [w, "twice"], "alt_input": f"other input {w}",
            "output": f"the answer about {w} follows here", "alt_output": f"a different answer for {w}",
            "messages": DIALOGUE, "alt_messages": [{"role": "user", "content": f"name {w}"},
                                                   {"role": "assistant", "content": f"{w} it is"}]}


@pytest.fixture(scope="module")
def tokenize(assets):
    import datasets

    from shardtune.config.schema import ModelConfig
    from shardtune.data.pipeline import tokenize_split
    from shardtune.model.hf import load_tokenizer

    docs = datasets.Dataset.from_list([row(i) for i in range(12)])
    tokenizer, done = load_tokenizer(ModelConfig(tokenizer=assets["tokenizer"])), {}

    def rows(cfg: DataConfig) -> list:
        if repr(cfg) not in done:
            tokenizer.chat_template = None  # data.chat_template is set on the tokenizer: none before it
            split = tokenize_split(docs, cfg, tokenizer, "the test rows", warn=lambda line: None)
            done[repr(cfg)] = [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in split[i].items()}
                               for i in range(len(split))]
        return done[repr(cfg)]

    return rows


def base(fmt: str) -> DataConfig:
    return DataConfig(format=fmt, seq_len=256, **({"chat_template": CHAT} if fmt == "chat" else {}))


def test_every_data_key_is_tried_or_said_to_be_checked_elsewhere():
    assert {f.name for f in dataclasses.fields(DataConfig)} == set(ANOTHER) | ELSEWHERE


@pytest.mark.parametrize("fmt", ["text", "instruct", "chat"])
@pytest.mark.parametrize("key", sorted(ANOTHER))
def test_a_key_changes_the_rows_exactly_where_it_is_not_warned_about(tokenize, fmt, key):
    for start in (base(fmt), dataclasses.replace(base(fmt), template="{a} and then {b}")):
        if key == "template" or (fmt == "chat" and start.template):
            continue  # data.template against itself / chat with a template: the first pass covers them
        cfg = dataclasses.replace(start, **{key: ANOTHER[key]})
        if key == "chat_template" and fmt == "chat":
            cfg = dataclasses.replace(start, chat_template=OTHER_CHAT)
        warned = [line for line in unread_data_keys(cfg) if line.startswith(f"warning: data.{key} ")]
        assert len(warned) <= 1
        changed = tokenize(cfg) != tokenize(start)
        assert changed != bool(warned), (f"data.{key}={ANOTHER[key]!r} with data.format={fmt}"
                                         f"{' and a template' if start.template else ''}: the rows "
                                         f"{'changed' if changed else 'did not change'}, but it was "
                                         f"{'warned about' if warned else 'not warned about'}: {warned}")


def test_the_rest_is_warned_about_where_it_has_no_effect(assets):
    import datasets

    from shardtune.config.schema import ModelConfig
    from shardtune.data.batches import sample_lengths
    from shardtune.data.pipeline import split_documents, tokenize_split
    from shardtune.model.hf import load_tokenizer

    # group_by_length sorts by the rows' lengths, which packed blocks do not have
    packed = DataConfig(format="instruct", packing=True, group_by_length=True, seq_len=256)
    assert warned_keys(packed) == ["data.group_by_length"]
    assert not warned_keys(dataclasses.replace(packed, packing=False))
    docs = datasets.Dataset.from_list([row(i) for i in range(12)])
    tokenizer = load_tokenizer(ModelConfig(tokenizer=assets["tokenizer"]))
    assert sample_lengths(tokenize_split(docs, packed, tokenizer, "rows", warn=lambda line: None)) is None
    assert sample_lengths(tokenize_split(docs, dataclasses.replace(packed, packing=False), tokenizer, "rows",
                                         warn=lambda line: None)) is not None
    # val_size carves validation out of train, which a named validation split replaces
    splits = {"train": docs, "test": docs.select(range(3))}

    def train_rows(**keys) -> int:
        return len(split_documents(DataConfig(path="rows", **keys), splits)[0])

    assert train_rows(val_split="test", val_size=0.5) == train_rows(val_split="test") == 12
    assert warned_keys(DataConfig(val_split="test", val_size=0.5)) == ["data.val_size"]
    assert train_rows(val_size=0.5) == 6 != train_rows() and not warned_keys(DataConfig(val_size=0.5))
    assert not warned_keys(DataConfig())  # the defaults say nothing


def warned_keys(cfg: DataConfig) -> list[str]:
    return [line.split()[1] for line in unread_data_keys(cfg)]


def test_the_check_says_the_warning(assets, tmp_path, capsys):
    from conftest import tiny_overrides
    from shardtune.check.run import check_run
    from shardtune.config.load import load_config
    from shardtune.resolve.run import resolve_run

    cfg = load_config(None, tiny_overrides(assets, tmp_path / "out", **{"data.chat_template": CHAT}), defaults={})
    check_run(resolve_run(cfg, 1, say=lambda line: None), 1)
    assert "warning: data.chat_template is read only with data.format=chat" in capsys.readouterr().out
