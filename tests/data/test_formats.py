"""Dataset formats (text templates, instruct, chat), padded batches and group_by_length.

Fixtures use the column names of the real datasets: yahma/alpaca-cleaned (instruction, input,
output), Abirate/english_quotes (quote, author, tags), amazingvince/lc0-test80-games (a list
column `moves`), HuggingFaceH4/ultrachat_200k (prompt, prompt_id, messages).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import TINY, llama_tokenizer, losses, tiny_overrides
from shardtune.config.load import load_config
from shardtune.config.schema import DataConfig
from shardtune.data import batches as B
from shardtune.data import chat
from shardtune.data import formats as F
from shardtune.data import pipeline as D
from shardtune.errors import UserError

IGNORE = D.IGNORE_INDEX
# A small ChatML-like template; <|endoftext|> is the quickstart tokenizer's EOS.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "Eat well, sleep enough and move every day."},
    {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a primary color.", "input": "", "output": "Blue."},
    {"instruction": "Translate to French.", "input": "good morning", "output": "bonjour"},
]
QUOTES = [
    {"quote": "Be yourself; everyone else is already taken.", "author": "Oscar Wilde",
     "tags": ["be-yourself", "inspirational"]},
    {"quote": "So many books, so little time.", "author": "Frank Zappa", "tags": ["books", "humor"]},
]
CHESS = [
    {"moves": ["e4", "e5", "Nf3", "Nc6"], "pgn": "1. e4 e5 2. Nf3 Nc6", "result": "1-0", "date": "2023.01.01"},
    {"moves": ["d4", "d5"], "pgn": "1. d4 d5", "result": "1/2-1/2", "date": "2023.01.02"},
]


def chat_row(i: int, turns: int = 2) -> dict:
    messages = [{"role": "system", "content": "Answer briefly."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i}.{t}?"},
                     {"role": "assistant", "content": f"answer {i}.{t}"}]
    return {"prompt": messages[1]["content"], "prompt_id": f"id{i}", "messages": messages}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["tokenizer"])


@pytest.fixture
def chat_tokenizer(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def kept(tokenizer, labels) -> str:
    return tokenizer.decode([t for t in labels if t != IGNORE])


# ----------------------------------------------------------------------------- text templates


def test_template_renders_quote_columns_and_joins_list_columns(tokenizer):
    cfg = DataConfig(path="x", template="Quote: {quote}\nAuthor: {author}\nTags: {tags}", list_sep=", ")
    docs, field = F.render_text(dataset(QUOTES), cfg, "quotes")
    assert docs[0][field] == ("Quote: Be yourself; everyone else is already taken.\nAuthor: Oscar Wilde\n"
                              "Tags: be-yourself, inspirational")
    # a plain string text_field passes through untouched
    same, field = F.render_text(dataset(QUOTES), DataConfig(path="x", text_field="quote"), "quotes")
    assert field == "quote" and same[1]["quote"] == QUOTES[1]["quote"]


def test_list_valued_text_field_becomes_one_line_of_moves(tmp_path, tokenizer):
    docs, field = F.render_text(dataset(CHESS), DataConfig(path="x", text_field="moves"), "games")
    assert docs[field] == ["e4 e5 Nf3 Nc6", "d4 d5"]
    docs, field = F.render_text(dataset(CHESS), DataConfig(path="x", template="{result} {moves}"), "games")
    assert docs[field][1] == "1/2-1/2 d4 d5"
    # and through prepare: packed blocks of exactly those tokens
    write_jsonl(tmp_path / "games.jsonl", CHESS * 40)
    cfg = DataConfig(path=str(tmp_path / "games.jsonl"), text_field="moves", seq_len=8, val_size=0)
    train, _ = D.prepare(cfg, tokenizer)
    assert train[:]["input_ids"].shape[1] == 8 and "labels" not in train.column_names
    eos = tokenizer.eos_token
    assert tokenizer.decode(train[:]["input_ids"].flatten()).startswith(f"e4 e5 Nf3 Nc6{eos}d4 d5{eos}")


@pytest.mark.parametrize("template, words", [
    ("Quote: {quote}\nBy: {writer}", ["no column 'writer'", "data.template", "quote, author, tags"]),
    ("{} by {author}", ["positional", "name a column"]),
    ("{quote", ["not a valid template", "{{ }}"]),
])
def test_bad_templates_are_one_line_user_errors(template, words):
    with pytest.raises(UserError) as err:
        F.render_text(dataset(QUOTES), DataConfig(path="x", template=template), "dataset 'quotes'")
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


# ----------------------------------------------------------------------------- instruct


def instruct_rows(rows, tokenizer, **kw):
    ds = dataset(rows)
    cfg = DataConfig(path="x", format="instruct", seq_len=kw.pop("seq_len", 512), **kw)
    return ds.map(F.instruct_fn(cfg, tokenizer, ds.column_names, "alpaca"), batched=True,
                  remove_columns=ds.column_names)


def test_instruct_masks_the_prompt_and_ends_the_response_with_eos(tokenizer):
    rows = instruct_rows(ALPACA, tokenizer)
    eos = tokenizer.eos_token
    for src, row in zip(ALPACA, rows, strict=True):
        text = tokenizer.decode(row["input_ids"])
        assert ("### Input:\n" + src["input"] in text) == bool(src["input"])  # the template without input
        assert text.endswith("### Response:\n" + src["output"] + eos)
        assert kept(tokenizer, row["labels"]) == src["output"] + eos
        n_prompt = len(row["labels"]) - len(tokenizer(src["output"])["input_ids"]) - 1
        assert row["labels"][:n_prompt] == [IGNORE] * n_prompt and row["length"] == len(row["input_ids"])
    full = instruct_rows(ALPACA[:1], tokenizer, train_on_inputs=True)[0]
    assert full["labels"] == full["input_ids"]



SAYS = st.lists(st.sampled_from(["The", "capital", "Paris", "🙂", "\n", "<s>", "</s>", "[INST]"]), min_size=1,
                max_size=4).map(" ".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(instruction=SAYS, output=SAYS, llama=st.booleans(),
       template=st.sampled_from([None, "<s>[INST] {instruction} [/INST]", "{instruction} [/INST]"]))
def test_an_instruct_example_has_one_bos_and_one_eos_of_its_own(tokenizer, instruction, output, llama, template):
    """The prompt after the tokenizer's BOS (llama-style), the response before EOS, neither doubled
    where the template or the row writes it (`<s>[INST] ...`, a response ending in `</s>`); the
    prompt `generate` sends is the one trained on."""
    tok = llama_tokenizer() if llama else tokenizer
    row = {"instruction": instruction, "input": "", "output": output}
    [got] = instruct_rows([row], tok, template=template).to_list()
    cfg = DataConfig(path="x", format="instruct", template=template)
    prompt = tok(F.instruct_prompt(cfg, row), add_special_tokens=False)["input_ids"]
    prompt = ([tok.bos_token_id] if llama and prompt[:1] != [tok.bos_token_id] else []) + prompt
    reply = tok(output, add_special_tokens=False)["input_ids"]
    reply += [tok.eos_token_id] if reply[-1:] != [tok.eos_token_id] else []
    assert got["input_ids"] == prompt + reply and got["labels"] == [IGNORE] * len(prompt) + reply
    assert F.instruct_prompt_ids(cfg, tok, row) == prompt


def test_instruct_field_names_and_prompt_template_are_configurable(tokenizer):
    qa = [{"question": "Capital of France?", "answer": "Paris"}]
    with pytest.raises(UserError, match="needs a column 'instruction'.*question, answer.*data.instruction_field"):
        instruct_rows(qa, tokenizer)
    row = instruct_rows(qa, tokenizer, instruction_field="question", output_field="answer")[0]
    assert "Capital of France?" in tokenizer.decode(row["input_ids"])
    row = instruct_rows(qa, tokenizer, template="Q: {question}\nA: ", output_field="answer")[0]
    assert tokenizer.decode(row["input_ids"]) == "Q: Capital of France?\nA: Paris" + tokenizer.eos_token
    with pytest.raises(UserError, match="needs a column 'output'.*data.output_field"):
        instruct_rows([{"instruction": "x", "response": "y"}], tokenizer)
    with pytest.raises(UserError, match="needs a column 'context'.*data.input_field"):  # a named input must exist
        instruct_rows(ALPACA, tokenizer, input_field="context")


def test_instruct_prepare_truncates_to_cutoff_len_and_drops_examples_with_no_response(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA * 10)
    prompt_len = len(tokenizer(F.PROMPT_NO_INPUT.format(instruction=ALPACA[0]["instruction"]))["input_ids"])
    cutoff = prompt_len + 3  # long enough for the no-input prompts only
    cfg = DataConfig(path=str(path), format="instruct", seq_len=256, cutoff_len=cutoff, val_size=4)
    said = []
    train = D.tokenize_split(D.load_documents(cfg)["train"], cfg, tokenizer, "alpaca", warn=said.append)
    assert len(train) == 20  # the examples with an input were dropped, and that was said
    whole = [len(tokenizer(F.instruct_prompt(cfg, r))["input_ids"] + tokenizer(r["output"])["input_ids"]) < cutoff
             for r in ALPACA * 10 if not r["input"]]  # the response and its EOS within the cutoff
    assert said == [f"warning: 20 of 40 examples of alpaca are left out: they have no response token within "
                    f"data.cutoff_len={cutoff} (cut off, or none at all)",
                    f"warning: {whole.count(False)} of 20 examples of alpaca are cut at data.cutoff_len={cutoff} "
                    "tokens before the end of their responses: their ends, and the end of turn or EOS, have no loss; "
                    "raise data.cutoff_len to keep them whole"] and 0 < whole.count(False) < 20
    assert [row["labels"][-1] == tokenizer.eos_token_id for row in train] == whole
    train, val = D.prepare(cfg, tokenizer)
    assert len(val) + len(train) < 40 and len(train) > 0
    assert max(B.sample_lengths(train)) <= cutoff and set(train.column_names) == {"input_ids", "labels", "length"}
    assert all((row["labels"][1:] != IGNORE).any() for row in train)
    with pytest.raises(UserError, match="cutoff_len"):
        D.prepare(DataConfig(path=str(path), format="instruct", seq_len=256, cutoff_len=8), tokenizer)
    with pytest.raises(UserError, match="between 2 and data.seq_len=64"):  # refused with the config, before data
        load_config(None, ["model.config={model_type: gpt2}", f"data.path={path}", "data.format=instruct",
                           "data.seq_len=64", "data.cutoff_len=100"])


def test_instruct_tokenizes_the_same_with_worker_processes(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA * 5)
    one, _ = D.prepare(DataConfig(path=str(path), format="instruct", val_size=0.25), tokenizer)
    two, _ = D.prepare(DataConfig(path=str(path), format="instruct", val_size=0.25, num_proc=2), tokenizer)
    assert len(one) == 15 and one.with_format(None)[:] == two.with_format(None)[:]


def test_instruct_packing_keeps_labels_aligned(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA * 10)
    cfg = DataConfig(path=str(path), format="instruct", seq_len=256, packing=True, val_size=0)
    train, _ = D.prepare(cfg, tokenizer)
    assert train[:]["input_ids"].shape == train[:]["labels"].shape and train[:]["input_ids"].shape[1] == 256
    real = train[:]["labels"] != IGNORE
    assert (train[:]["labels"][real] == train[:]["input_ids"][real]).all() and 0 < real.float().mean() < 1


# ----------------------------------------------------------------------------- chat


def chat_rows(rows, tokenizer, **kw):
    ds = dataset(rows)
    cfg = DataConfig(path="x", format="chat", seq_len=512, **kw)
    return ds.map(chat.chat_fn(cfg, tokenizer, ds.column_names, "ultrachat"), batched=True, with_indices=True,
                  remove_columns=ds.column_names)


def test_chat_loss_is_on_assistant_turns_only(chat_tokenizer):
    rows = chat_rows([chat_row(0, turns=2), chat_row(1, turns=1)], chat_tokenizer)
    eos = chat_tokenizer.eos_token
    row = rows[0]
    text = chat_tokenizer.decode(row["input_ids"])
    assert text == chat_tokenizer.apply_chat_template(chat_row(0)["messages"], tokenize=False)  # nothing added
    assert kept(chat_tokenizer, row["labels"]) == f"answer 0.0{eos}answer 0.1{eos}"
    # the masked tokens are exactly everything else
    masked = chat_tokenizer.decode([t for t, lab in zip(row["input_ids"], row["labels"], strict=True) if lab == IGNORE])
    assert "question 0.1?" in masked and "answer" not in masked and "<|assistant|>" in masked
    assert kept(chat_tokenizer, rows[1]["labels"]) == f"answer 1.0{eos}"
    everything = chat_rows([chat_row(0)], chat_tokenizer, train_on_inputs=True)[0]
    assert everything["labels"] == everything["input_ids"]



def test_a_conversation_is_counted_as_cut_only_where_a_token_with_a_loss_is_cut_off(chat_tokenizer):
    """The newline after the last end of turn has no loss: cutting it off cuts nothing trained."""
    [whole] = chat_rows([chat_row(0)], chat_tokenizer)["input_ids"]
    assert chat_tokenizer.decode(whole[-2:]) == "<|endoftext|>\n"
    for cutoff, cut in ((len(whole), False), (len(whole) - 1, False), (len(whole) - 2, True)):
        [row] = chat_rows([chat_row(0)], chat_tokenizer, cutoff_len=cutoff).to_list()
        assert row["cut"] == cut and row["input_ids"] == whole[:cutoff] and row["length"] == cutoff


def test_chat_template_that_rewrites_history_falls_back_to_the_message_text(chat_tokenizer):
    # Marks the final message, so a prefix render is not a prefix of the full render.
    chat_tokenizer.chat_template = ("{% for m in messages %}{% if loop.last %}[final]{% endif %}"
                                    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}")
    row = chat_rows([chat_row(3)], chat_tokenizer)[0]
    assert kept(chat_tokenizer, row["labels"]).split() == ["answer", "3.0", "answer", "3.1"]


def test_chat_errors(chat_tokenizer, tokenizer):
    with pytest.raises(UserError, match="no chat template.*data.chat_template"):
        chat_rows([chat_row(0)], tokenizer)
    with pytest.raises(UserError, match="needs a column 'messages'.*data.messages_field"):
        chat_rows(ALPACA, chat_tokenizer)
    bad = [{"prompt": "x", "prompt_id": "y", "messages": "just text"}]
    with pytest.raises(UserError, match="row 0 .*not a list of"):
        chat_rows(bad, chat_tokenizer)


def sharegpt_row(i: int, turns: int = 2) -> dict:
    """chat_row(i) as ShareGPT datasets hold it (e.g. anon8231489123/ShareGPT_Vicuna_unfiltered: id, conversations)."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"id": f"id{i}", "conversations": [{"from": names[m["role"]], "value": m["content"]}
                                              for m in chat_row(i, turns)["messages"]]}


def test_sharegpt_messages_are_the_same_messages(chat_tokenizer):
    rows = [chat_row(0, turns=2), chat_row(1, turns=1)]
    shared = chat_rows([sharegpt_row(0, turns=2), sharegpt_row(1, turns=1)], chat_tokenizer,
                       messages_field="conversations")
    assert shared["input_ids"] == chat_rows(rows, chat_tokenizer)["input_ids"]
    assert shared["labels"] == chat_rows(rows, chat_tokenizer)["labels"]
    broken = sharegpt_row(2)
    broken["conversations"][2]["value"] = None
    docs = dataset([sharegpt_row(0), broken])
    with pytest.raises(UserError, match="no content \\(null\\), the first in row 1"):
        D.tokenize_split(docs, DataConfig(path="x", format="chat", seq_len=512, messages_field="conversations"),
                         chat_tokenizer, "sharegpt", warn=lambda line: None)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(st.tuples(st.sampled_from(["user", "assistant"]),
                                        st.one_of(st.none(), st.text("ab ", min_size=1, max_size=5))),
                              min_size=1, max_size=3), min_size=1, max_size=4))
def test_a_message_without_content_is_refused_in_one_line(chat_tokenizer, rows):
    """Whatever the rows, a null content anywhere is refused before tokenizing, naming the first
    row that has one; rows whose messages all hold text tokenize."""
    docs = dataset([{"messages": [{"role": r, "content": c} for r, c in row]} for row in rows])
    cfg = DataConfig(path="x", format="chat", seq_len=512)
    nulls = [i for i, row in enumerate(rows) if any(c is None for _, c in row)]
    try:
        D.tokenize_split(docs, cfg, chat_tokenizer, "ultrachat", warn=lambda line: None)
    except UserError as exc:
        assert nulls and "no content (null), the first in row " + str(nulls[0]) in str(exc), str(exc)
        assert "\n" not in str(exc)
        return
    assert not nulls


def test_chat_template_from_config_is_installed_and_used(tmp_path, assets, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])  # no template of its own
    path = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(12)])
    cfg = DataConfig(path=str(path), format="chat", seq_len=128, chat_template=CHAT_TEMPLATE, val_size=2)
    train, val = D.prepare(cfg, tok)
    assert tok.chat_template == CHAT_TEMPLATE and len(train) == 10 and len(val) == 2
    assert kept(tok, train[0]["labels"]).startswith("answer ")
    assert "chat template ends an assistant turn" not in capsys.readouterr().err
    open_ended = CHAT_TEMPLATE.replace("<|endoftext|>", "\n")
    train, _ = D.prepare(dataclasses.replace(cfg, chat_template=open_ended), tok)
    assert tok.eos_token_id not in [t for row in train for t in row["labels"].tolist()]  # no reply ends
    assert capsys.readouterr().err.count("chat template ends an assistant turn with no token") == 1


@pytest.mark.parametrize("template, warned", [
    (CHAT_TEMPLATE, False),  # <|endoftext|> ends every turn
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\r\n\r\n{% endfor %}", True),
    ("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}{% if add_generation_prompt %}:{% endif %}",
     True),
    ("{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}[end]{% endif %}{% endfor %}", False),
    ("{{ raise_exception('a system turn first') }}", False),  # refused where the rows are read
])
def test_a_chat_template_whose_turns_end_in_no_token_is_warned_of(chat_tokenizer, template, warned):
    """Only whitespace after a reply: no token after one has a loss, so the model never learns to
    end a reply; said once, in a line naming data.chat_template."""
    line = chat.unended_turns(DataConfig(path="x", format="chat", chat_template=template), chat_tokenizer)
    assert (line is not None) == warned and (line is None or "data.chat_template" in line and "\n" not in line)


# ----------------------------------------------------------------------------- batches


def test_collate_pads_variable_rows_and_masks_padding(tokenizer):
    import datasets
    import torch

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10], [11, 12]],
                                     "labels": [[IGNORE, IGNORE, 7, 8], [IGNORE, 10], [11, 12]]}
                                    ).with_format("torch")
    b = B.collate(ds, [0, 1, -1], torch.device("cpu"), pad_id=99)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 99, 99], [5, 6, 7, 8]]
    assert b["labels"].tolist() == [[IGNORE, IGNORE, 7, 8], [IGNORE, 10, IGNORE, IGNORE], [IGNORE] * 4]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]
    same = B.collate(ds, [1, 2], torch.device("cpu"), pad_id=99)  # nothing to pad: no mask
    assert set(same) == {"input_ids", "labels"} and same["labels"].tolist() == [[IGNORE, 10], [11, 12]]
    no_labels = B.collate(ds.remove_columns("labels"), [0, 1], torch.device("cpu"))
    assert no_labels["labels"].tolist() == [[5, 6, 7, 8], [9, 10, IGNORE, IGNORE]]


def test_group_by_length_batches_similar_lengths_the_same_for_every_world_size():
    import random

    n, global_batch, micro = 1000, 8, 2
    lengths = [random.Random(i).randint(5, 500) for i in range(n)]

    def padding(plan, epoch):
        total = 0
        for step in range(plan.steps_per_epoch):
            for mb in plan.micro_batches(epoch, step):
                total += sum(max(lengths[i] for i in mb) - lengths[i] for i in mb)
        return total

    grouped = B.BatchPlan(n, global_batch, micro, 1, 0, seed=3, lengths=lengths)
    plain = B.BatchPlan(n, global_batch, micro, 1, 0, seed=3)
    assert padding(grouped, 0) < padding(plain, 0) / 5
    order = grouped.order(0).tolist()
    assert sorted(order) == list(range(n))  # a permutation
    assert order == B.BatchPlan(n, global_batch, micro, 1, 0, seed=3, lengths=lengths).order(0).tolist()
    assert order != grouped.order(1).tolist()
    first_batch_lengths = [lengths[i] for i in order[:global_batch]]
    assert first_batch_lengths == sorted(first_batch_lengths, reverse=True)
    starts = [lengths[order[s * global_batch]] for s in range(grouped.steps_per_epoch)]
    assert starts != sorted(starts, reverse=True)  # batches are shuffled, not longest first overall
    for world in (2, 4):
        for epoch, step in [(0, 0), (0, 17), (1, 60)]:
            want = sorted(i for mb in grouped.micro_batches(epoch, step) for i in mb)
            got = sorted(i for r in range(world) for mb in
                         B.BatchPlan(n, global_batch, micro, world, r, seed=3, lengths=lengths)
                         .micro_batches(epoch, step) for i in mb)
            assert got == want


def test_padded_instruct_batches_keep_every_loss_token(tmp_path, tokenizer):
    import torch

    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA * 4)
    train, _ = D.prepare(DataConfig(path=str(path), format="instruct", val_size=0), tokenizer)
    (mb,) = B.BatchPlan(len(train), 16, 16, 1, 0, seed=0).micro_batches(0, 0)
    batch = B.collate(train, mb, torch.device("cpu"), pad_id=tokenizer.pad_token_id)
    assert int((batch["labels"] != IGNORE).sum()) == sum(int((train[i]["labels"] != IGNORE).sum()) for i in mb)
    assert batch["attention_mask"].sum(1).tolist() == [len(train[i]["input_ids"]) for i in mb]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id).all()
    # grouped by length, these four distinct examples (x4) need no padding at all
    grouped = B.BatchPlan(len(train), 16, 4, 1, 0, seed=0, lengths=B.sample_lengths(train))
    assert not any("attention_mask" in B.collate(train, mb, torch.device("cpu")) for mb in grouped.micro_batches(0, 0))


def test_instruct_run_trains_three_steps(assets, tmp_path):
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA * 12)
    model = json.dumps({**TINY["gpt2"], "n_positions": 256})
    overrides = tiny_overrides(assets, tmp_path / "run", **{
        "model.config": model, "data.format": "instruct", "data.path": str(path), "data.seq_len": 256,
        "data.group_by_length": "true", "train.max_steps": 3, "data.val_size": 8})
    results = run(load_config(None, overrides, defaults={}), overwrite=True)
    got = losses(tmp_path / "run")
    assert len(got) == 3 and all(math.isfinite(x) for x in got)
    assert math.isfinite(results["last"]["eval_loss"]) and (tmp_path / "run" / "final").is_dir()


def test_empty_cells_are_counted_once_each_across_chunks():
    """Nulls and blank texts are counted once each (a null is not also blank), chunk after chunk
    (the first chunk here is all null), for text and for lists of messages."""
    import datasets

    for fmt, column, blank in (("text", "text", " "), ("chat", "messages", [])):
        filled = "text" if fmt == "text" else [{"role": "user", "content": "hi"}]
        docs = datasets.Dataset.from_dict({column: [None] * 1200 + [blank] * 300 + [filled] * 500})
        warned = []
        F.check_cells(docs, DataConfig(path="x", format=fmt), "the data", warned.append)
        key = "data.text_field" if fmt == "text" else "data.messages_field"
        assert warned == [f"warning: column {column!r} of the data ({key}) is null or empty in 1500 of 2000 rows"]




@pytest.mark.parametrize(("fmt", "column", "values", "names_template"), [
    ("text", "text", [5, 6], True), ("instruct", "instruction", [5, 6], True), ("instruct", "input", [5, "x"], True),
    ("instruct", "output", [5, 6], False), ("instruct", "output", [5, "x"], False),
    ("chat", "messages", [5, 6], False)])
def test_a_refused_column_of_numbers_names_data_template_only_where_it_would_format_that_column(
        tmp_path, fmt, column, values, names_template):
    """data.template formats a document or an instruct prompt: a response of numbers (a math set's
    answers) or chat messages were told to "use data.template", which never reads them."""
    from shardtune.data.files import read_path

    rows = [{"text": "t", "instruction": "i", "input": "x", "output": "o", column: v} for v in values]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = read_path(tmp_path, "x")["train"]  # numbers beside text: a column of JSON values
    with pytest.raises(UserError, match=f"column '{column}'") as exc:
        F.check_cells(docs, DataConfig(path="x", format=fmt), "the data", lambda line: None)
    assert ("data.template" in str(exc.value)) == names_template, exc.value


PIECES = st.lists(st.sampled_from(["a", " ", "<|endoftext|>", "<|endof", "text|>", "<s>", "</s", ">", "<|im_end|>"]),
                  max_size=4).map("".join).filter(str.strip)
CELL_SHAPES = {  # a cell of each shape a format reads from its pieces of text, and the text it tokenizes
    "text": (lambda ps: ps[0], lambda ps: ps[:1]),
    "list": (lambda ps: ps, lambda ps: [" ".join(ps)]),
    "messages": (lambda ps: [{"role": "user", "content": p} for p in ps], lambda ps: ps),
    "parts": (lambda ps: [{"role": "user", "content": [{"type": "text", "text": p} for p in ps]}],
              lambda ps: ["".join(ps)]),
    "sharegpt": (lambda ps: [{"from": "gpt", "value": p} for p in ps], lambda ps: ps),
    "template": (lambda ps: ps, lambda ps: [" ".join(ps)]),  # a list column of data.template="{text}!"
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(list(CELL_SHAPES)), llama=st.booleans(),
       rows=st.lists(st.lists(PIECES, min_size=1, max_size=3), min_size=1, max_size=5))
@example(shape="parts", llama=False, rows=[["a<|endof", "text|>"], ["<|endof", " text|>"]])
def test_rows_holding_a_special_tokens_text_are_counted_in_a_warning(tokenizer, shape, llama, rows):
    """A special token's text in the data is read as the token (here as in transformers): the rows
    that hold one, in any shape of cell (a text part split across two parts too), are counted and
    the tokens named in one warning line; rows of other text are never counted."""
    tok = llama_tokenizer() if llama else tokenizer
    specials = [t for t in tok.all_special_tokens if t != "<unk>"] if llama else ["<|endoftext|>"]
    cell, read = CELL_SHAPES[shape]
    chats = shape in ("messages", "parts", "sharegpt")
    column = "conversations" if shape == "sharegpt" else "messages" if chats else "text"
    cfg = DataConfig(path="x", format="chat" if chats else "text", messages_field=column,
                     template="{text}!" if shape == "template" else None)
    warned = []
    F.check_cells(dataset([{column: cell(r)} for r in rows]), cfg, "the data", warned.append, tok)
    found = [{s for s in specials if any(s in t for t in read(r))} for r in rows]
    marked = [w for w in warned if "special token" in w]
    assert len(marked) == any(found), warned
    if marked:
        assert marked[0].startswith(f"warning: {sum(map(bool, found))} of {len(rows)} rows of column {column!r}")
        named = marked[0].split("special token (")[1].split(")")[0].split(", ")
        assert set(named) <= set.union(*found) and "\n" not in marked[0]


def _shouted(content, where):
    return content.upper()


def test_a_change_to_the_tokenizing_code_is_not_served_from_the_datasets_cache(tmp_path, chat_tokenizer, monkeypatch):
    """`datasets` keys its cache of a tokenized split by the map function's code and the functions it
    calls, not those they call: a fixed chat._opening (which finds an opening reply) kept its cached,
    wrong labels."""
    import datasets

    from shardtune.data import messages

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "chats.jsonl", [chat_row(i) for i in range(4)])), format="chat",
                     seq_len=128)
    docs = D.load_documents(cfg)["train"]
    assert docs.cache_files  # so the tokenization is cached on disk
    assert "answer 0.0" in kept(chat_tokenizer, D.tokenize_split(docs, cfg, chat_tokenizer, "chats")[0]["labels"])
    # as an edit of messages.py would: the same function, named the same, with other code
    monkeypatch.setattr(messages._text, "__code__", _shouted.__code__)
    assert "ANSWER 0.0" in kept(chat_tokenizer, D.tokenize_split(docs, cfg, chat_tokenizer, "chats")[0]["labels"])


def _reversed_fill(template, row, sep=" "):
    return "".join(reversed(str(row)))


def _one_token_docs(docs, field, tokenizer, num_proc, dtype):
    import numpy as np

    yield np.zeros(len(docs), dtype=dtype), np.ones(len(docs), dtype="int64")


def test_a_change_to_the_text_code_is_not_served_from_a_cache(tmp_path, chat_tokenizer, monkeypatch):
    """The same for text: the packed token files were keyed by a version bumped by hand, so an edit of
    packing.py kept serving the tokens written before it (the render map's own cache, keyed by
    `datasets`, already sees an edit of formats.fill: checked here too)."""
    import datasets

    from shardtune.data import packing

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = [{"title": f"t{i}", "body": "the answer is " * (i + 1)} for i in range(8)]
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "docs.jsonl", rows)), template="{title}: {body}", seq_len=16)
    docs = D.load_documents(cfg)["train"]
    assert docs.cache_files

    def tokens() -> list[int]:
        blocks = D.tokenize_split(docs, cfg, chat_tokenizer, "docs")
        return [int(t) for i in range(len(blocks)) for t in blocks.block(i)["input_ids"]]

    first = tokens()
    assert tokens() == first  # cached, and the same
    monkeypatch.setattr(F.fill, "__code__", _reversed_fill.__code__)  # as an edit of formats.fill would
    rendered = tokens()
    assert rendered != first
    monkeypatch.setattr(packing._encoded_chunks, "__code__", _one_token_docs.__code__)  # an edit of packing.py
    assert tokens() != rendered
