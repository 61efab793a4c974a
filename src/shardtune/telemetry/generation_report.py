"""The generation-quality part of `shardtune report`: a run's generation.json (written by
`shardtune eval RUN --generate N`) as a bar chart of its scores, base beside fine-tuned, a table
of the numbers, and a few example generations. The file records the training step of the model
it scored; where the run has since logged another step (a resume trained it further), the section
says whose scores they are and how to score the current model, rather than showing them as the
run's. A file without the step (older shardtune) is read as before, with that said."""

from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError
from shardtune.fsio import json_loads

FILE = "generation.json"
SHOWN = 5  # example generations in report.md
UNIT_SCALE = ("rouge", "distinct_", "rep_", "empty_rate", "mauve")  # scores in [0, 1], drawn x100 as points


def read_generation(run: Path) -> dict | None:
    path = run / FILE
    if not path.is_file():
        return None
    try:
        data = json_loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):  # not JSON, not text, an integer past Python's digit limit
        data = None
    if not _well_formed(data):
        raise UserError(f"{str(path)!r} is not a generation-quality file of `shardtune eval --generate`; "
                        "rerun that command or remove the file")
    return data


def _well_formed(data) -> bool:
    """Every part the report reads, of the type `eval --generate` writes it (an edited or foreign
    file failed half-way through the report with whatever the first odd part raised)."""
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or "model" not in models:
        return False
    roles = [r for r in ("base", "model") if r in models]
    for role in roles:
        scores = models[role].get("scores") if isinstance(models[role], dict) else None
        if not isinstance(scores, dict) or not all(
                v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores.values()):
            return False
    examples = data.get("examples", [])
    return isinstance(data.get("settings", {}), dict) and isinstance(examples, list) and all(
        isinstance(ex, dict) and all(isinstance(ex.get(k, ""), str) for k in ("prompt", "reference", *roles))
        for ex in examples)


def scored_step(data: dict) -> int | None:
    """The training step of the model generation.json scored; None where not recorded."""
    step = data["models"]["model"].get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def not_current(run: Path, data: dict, step: int | None) -> str | None:
    """Why `run`'s generation.json may not be of its model at `step` (of its weights) and how to
    score that one; None where it is, or where there is no run to compare with."""
    scored = scored_step(data)
    if step is None or scored == step:
        return None
    rerun = (f"rerun `shardtune eval {run} --generate {data.get('settings', {}).get('generate', 'N')}` (with its "
             "other options as before) to score that")
    if scored is None:
        return (f"{str(run / FILE)!r} does not record which step's model it scored (an older shardtune wrote it); "
                f"the run is at step {step}: {rerun}")
    return (f"{str(run / FILE)!r} holds the scores of the model at step {scored}, not of the run's model now "
            f"(step {step}): {rerun}")


def points(key: str, value) -> float | None:
    """A score as its bar's height; None (no bar) for one a plot cannot draw (NaN, inf, 1e400)."""
    from shardtune.telemetry.plots import plottable

    height = value * 100 if key.startswith(UNIT_SCALE) and plottable(value) else value
    return height if plottable(height) else None


def cell(text: str, width: int = 120) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def generation_section(name: str, data: dict, out: Path, note: str | None = None) -> list[str]:
    """Markdown lines for one run's generation.json (`note`: `not_current`'s); draws OUT/generation-NAME.png."""
    from shardtune.telemetry.plots import fmt, save_bars

    models = data["models"]
    roles = [r for r in ("base", "model") if r in models]
    labels = {"base": "base", "model": "fine-tuned" if "base" in models else "model"}
    keys = [k for k in models["model"]["scores"] if k != "mean_words"]  # words are not points: table only
    stem = f"generation-{name}"
    bars = [(labels[r], "//" if r == "base" else None, [f"C{i}"] * len(keys),
             [points(k, models[r]["scores"].get(k, 0.0)) for k in keys]) for i, r in enumerate(roles)]
    save_bars(out / f"{stem}.png", f"Generation quality: {name}", "points (0-100; ROUGE, distinct, rep x100)",
              keys, bars)
    s = data.get("settings", {})
    step = scored_step(data)
    lines = [f"## Generation quality: {name}" + ("" if step is None else f" (model at step {step})"), ""]
    lines += [f"> **Not the run's current model:** {note}", ""] if note else []
    lines += [f"{s.get('prompts')} prompts of {s.get('data')} ({s.get('format')}), {s.get('max_new_tokens')} new "
             f"tokens, temperature {s.get('temperature')}, seed {s.get('seed')}", "",
             "| score | " + " | ".join(labels[r] for r in roles) + " |", "|---|" + "---|" * len(roles)]
    lines += [f"| {k} | " + " | ".join(fmt(models[r]["scores"].get(k)) for r in roles) + " |"
              for k in models["model"]["scores"]]
    lines += ["", f"![{stem}]({stem}.png)", "", "| prompt (end) | reference | "
              + " | ".join(labels[r] for r in roles) + " |", "|---|---|" + "---|" * len(roles)]
    for ex in data.get("examples", [])[:SHOWN]:
        lines.append(f"| {cell(ex.get('prompt', '')[-100:], 100)} | {cell(ex.get('reference', ''))} | "
                     + " | ".join(cell(ex.get(r, "")) for r in roles) + " |")
    return lines + [""]
