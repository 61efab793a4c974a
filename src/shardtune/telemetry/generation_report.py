"""The generation-quality part of `shardtune report`: a run's generation.json (written by
`shardtune eval RUN --generate N`) as a bar chart of its scores, base beside fine-tuned, a table
of the numbers, and a few example generations."""

from __future__ import annotations

import json
from pathlib import Path

from shardtune.errors import UserError

FILE = "generation.json"
SHOWN = 5  # example generations in report.md
UNIT_SCALE = ("rouge", "distinct_", "rep_", "empty_rate", "mauve")  # scores in [0, 1], drawn x100 as points


def read_generation(run: Path) -> dict | None:
    path = run / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["models"]["model"]["scores"]  # noqa: B018  the part the report needs
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{str(path)!r} is not a generation-quality file of `shardtune eval --generate`; "
                        "rerun that command or remove the file") from None
    return data


def points(key: str, value: float) -> float:
    return value * 100 if key.startswith(UNIT_SCALE) else value


def cell(text: str, width: int = 120) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def generation_section(name: str, data: dict, out: Path) -> list[str]:
    """Markdown lines for one run's generation.json; draws OUT/generation-NAME.png."""
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
    lines = [f"## Generation quality: {name}", "",
             f"{s.get('prompts')} prompts of {s.get('data')} ({s.get('format')}), {s.get('max_new_tokens')} new "
             f"tokens, temperature {s.get('temperature')}, seed {s.get('seed')}", "",
             "| score | " + " | ".join(labels[r] for r in roles) + " |", "|---|" + "---|" * len(roles)]
    lines += [f"| {k} | " + " | ".join(fmt(models[r]["scores"].get(k)) for r in roles) + " |"
              for k in models["model"]["scores"]]
    lines += ["", f"![{stem}]({stem}.png)", "", "| prompt (end) | reference | "
              + " | ".join(labels[r] for r in roles) + " |", "|---|---|" + "---|" * len(roles)]
    for ex in data.get("examples", [])[:SHOWN]:
        lines.append(f"| {cell(ex['prompt'][-100:], 100)} | {cell(ex['reference'])} | "
                     + " | ".join(cell(ex.get(r, "")) for r in roles) + " |")
    return lines + [""]
