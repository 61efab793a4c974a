"""`shardtune report` on run folders as a user may have named or edited them: drawn, or one line
(exit 2) naming the file, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

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
