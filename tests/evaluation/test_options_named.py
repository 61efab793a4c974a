"""eval has no data.* keys: what the data pipeline says inside `options_named` (its refusals and
its warnings alike) names the eval option that sets each key."""

from __future__ import annotations

import json

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import pipeline
from shardtune.errors import UserError
from shardtune.evaluation.evaluate import options_named

ROWS = [{"instruction": "Add the two numbers " + "and more " * n, "input": "", "output": "5"} for n in range(8)]


def test_a_warning_of_evals_data_names_its_option(tmp_path, assets, capsys):
    """`eval RUN --data FILE --format instruct --seq-len 125`: 'examples are left out: no response token
    within data.seq_len=125', a key eval's user cannot set (its refusal already said --seq-len)."""
    from transformers import AutoTokenizer

    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = DataConfig(path=str(path), format="instruct", seq_len=125)
    tokenizer = AutoTokenizer.from_pretrained(assets["tokenizer"])
    docs = pipeline.load_documents(cfg)["train"]
    with options_named(True):
        rows = pipeline.tokenize_split(docs, cfg, tokenizer, "eval.jsonl", required=True)
    err = capsys.readouterr().err
    assert 0 < len(rows) < len(ROWS) and "left out" in err and "within --seq-len=125" in err, err
    assert "data." not in err, err
    with options_named(False):  # the run's own data as it trained: the run's keys
        pipeline.tokenize_split(docs, cfg, tokenizer, "eval.jsonl", required=True)
    assert "within data.seq_len=125" in capsys.readouterr().err
    with pytest.raises(UserError, match="raise --seq-len"), options_named(True):
        pipeline.tokenize_split(docs, DataConfig(path=str(path), format="instruct", seq_len=50), tokenizer, "x",
                                required=True)
