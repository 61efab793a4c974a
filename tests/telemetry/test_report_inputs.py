"""`shardtune report` on run folders as a user may have named or edited them: drawn, or one line
(exit 2) naming the file, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import main_in_process

GENERATION = {"settings": {"generate": 2, "data": "d.jsonl", "format": "text", "prompts": 1, "max_new_tokens": 4,
                           "temperature": 0.0, "seed": 0},
              "models": {"model": {"spec": "run", "step": 1, "scores": {"rouge1": 0.3, "bleu": 4.0}}},
              "examples": [{"prompt": "a prompt", "reference": "its end", "model": "an end"}]}


def _run(folder: Path, generation: dict | None = None) -> Path:
    """A run folder of one logged step (one plot to draw) and, if given, its generation.json."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    if generation is not None:
        (folder / "generation.json").write_text(json.dumps(generation))
    return folder


def _edited(path: tuple, value):
    """GENERATION with the part at `path` replaced by `value` (the whole file for ())."""
    if not path:
        return value
    data = json.loads(json.dumps(GENERATION))
    part = data
    for key in path[:-1]:
        part = part[key]
    part[path[-1]] = value
    return data


def test_dollar_signs_in_names_are_drawn_as_text(tmp_path):
    """matplotlib read `$...$` in a label as mathtext: a run folder `a$\\x$b` (or a score named so)
    failed the whole report with its parse error."""
    run = _run(tmp_path / "a$\\x$b", _edited(("models", "model", "scores", "x$\\frac$"), 1.0))
    rc, err = main_in_process(["report", str(run), "--out", str(tmp_path / "report")])
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["generation-a$\\x$b.png", "loss.png",
                                                                        "report.md"]


@pytest.mark.parametrize("path, value", [
    (("models", "model", "scores"), [1, 2]),
    (("models", "model", "scores"), "high"),
    (("models", "model", "scores", "bleu"), "high"),
    (("models", "base"), [1]),
    (("settings",), [1]),
    (("examples",), {"a": 1}),
    (("examples",), [5]),
    (("examples", 0, "prompt"), 5),
    ((), ["models"]),
])
def test_a_generation_file_of_other_types_is_one_line(tmp_path, path, value):
    """Each of these failed half-way through the report with whatever its part raised."""
    run = _run(tmp_path / "run", _edited(path, value))
    rc, err = main_in_process(["report", str(run), "--out", str(tmp_path / "report")])
    assert rc == 2 and err.count("\n") == 1, err
    assert "generation.json' is not a generation-quality file" in err and not (tmp_path / "report").exists()


def test_scores_a_plot_cannot_draw_get_no_bar(tmp_path):
    """A score of NaN, inf, null or 10**400 (an edited file): its bar is left out (10**400 failed
    matplotlib's conversion), the table says it as it is."""
    scores = {"rouge1": float("nan"), "bleu": float("inf"), "chrf": None, "rougeL": 10 ** 400, "rouge2": 0.2}
    run = _run(tmp_path / "run", _edited(("models", "model", "scores"), scores))
    rc, err = main_in_process(["report", str(run), "--out", str(tmp_path / "report")])
    assert rc == 0, err
    assert "| rouge2 | 0.2 |" in (tmp_path / "report" / "report.md").read_text()


def test_a_report_into_the_working_directory_is_one_line(tmp_path, monkeypatch):
    """`--out .` escaped as a traceback (fsio.whole_folder; test_fsio.py has the mechanism)."""
    run = _run(tmp_path / "run")
    monkeypatch.chdir(run)
    rc, err = main_in_process(["report", ".", "--out", "."])
    assert rc == 2 and "report folder" in err and "is the working directory" in err and err.count("\n") == 1, err
    assert os.listdir(run) == ["metrics.jsonl"]


RECORDS = st.lists(st.fixed_dictionaries({"step": st.integers(0, 10 ** 6)}, optional={
    "loss": st.floats(allow_nan=False), "eval": st.dictionaries(st.text(max_size=3), st.integers())}), min_size=1,
    max_size=4)


@settings(max_examples=50, deadline=None)
@given(rows=RECORDS, cut=st.integers(0, 10 ** 4))
def test_an_unfinished_last_line_is_left_out(tmp_path_factory, rows, cut):
    """A run still writing its last line, or one a full disk cut short, was refused whole as damaged:
    wherever the last line is cut, the lines before it are read (and all of it once it is whole)."""
    from shardtune.telemetry.report import read_metrics

    folder = tmp_path_factory.mktemp("run")
    text = "".join(json.dumps(r) + "\n" for r in rows)
    last = len(json.dumps(rows[-1]))
    cut = len(text) - 1 - cut % (last + 1)  # within the last line, its newline and none to all of its text
    (folder / "metrics.jsonl").write_text(text[:cut])
    assert read_metrics(folder) == (rows if cut == len(text) - 1 else rows[:-1])


def test_a_damaged_line_before_the_last_is_refused(tmp_path):
    from shardtune.errors import UserError
    from shardtune.telemetry.report import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(UserError, match="line 1 is not JSON"):
        read_metrics(tmp_path)
    path.write_text('{"step": 1, "loss": 2.0}')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_a_diverged_last_evaluation_is_the_final_one(tmp_path):
    """An evaluation whose loss overflowed (eval_ppl inf, or NaN) was left out of the summary as
    a plot leaves it out: the table's final perplexity was the last finite one, the run looking fine."""
    from shardtune.telemetry.report import summarize, write_report

    for bad in (float("inf"), float("nan")):
        rows = [{"step": 0, "eval_ppl": 148.4}, {"step": 5, "loss": 2.0, "eval_ppl": 7.39},
                {"step": 10, "loss": 9.0, "eval_ppl": bad}]
        got = summarize("a", rows)
        assert repr(got["final eval ppl"]) == repr(bad) and got["best eval ppl"] == 7.39
        assert got["first eval ppl"] == 148.4 and got["final loss"] == 9.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "| nan | 7.39 |" in write_report([tmp_path], tmp_path / "rep").read_text()


@pytest.mark.parametrize("ckpt, noted", [(1, False), (None, True)])
def test_generation_scores_are_compared_with_the_weights_the_run_has(tmp_path, capsys, ckpt, noted):
    """A run killed at step 3 after its checkpoint of step 1: `eval RUN --generate` scores step 1 (its
    newest weights), but the report compared that with the last logged step (3) and said to rerun eval
    --generate, which scored step 1 again. Compared with the step of the weights every command reads
    (checkpoint.folders.run_weights); without weights, the logged step."""
    run = _run(tmp_path / "run", GENERATION)
    (run / "config.yaml").write_text("{}\n")
    with (run / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps({"step": s, "loss": 4.0}) + "\n" for s in (2, 3)))
    if ckpt is not None:
        folder = run / "checkpoints" / f"step-{ckpt:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": ckpt, "config": {}}))
        (folder / ".metadata").write_text("")
    rc, err = main_in_process(["report", str(run), "--out", str(tmp_path / "report")])
    assert rc == 0, err
    assert ("rerun `shardtune eval" in (tmp_path / "report" / "report.md").read_text()) is noted
