"""What `shardtune sweep --search` leaves in its folder: search.csv (one row per trial),
search.md (the best config as a ready command line, the table of trials, the plots), and plots
drawn with matplotlib: the optimization history, parameter importance, and the objective
against each numeric parameter (the learning-rate vs loss curve)."""

from __future__ import annotations

import csv
import io
import shlex
from pathlib import Path

from shardtune.fsio import write_text_atomic
from shardtune.telemetry.plots import fmt, save_bars, save_plot


def trial_rows(study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        record = t.user_attrs.get("record", {})
        last_step = max(t.intermediate_values) if t.intermediate_values else None
        rows.append({"trial": t.number, "state": t.state.name.lower(), "value": t.value, **t.params,
                     "last_step": last_step, "seconds": record.get("seconds"), "note": record.get("note", "")})
    return rows


def best_command(sweep, best) -> str:
    """The `shardtune train` command line of the best trial: the recipe, the sweep's overrides,
    the best values."""
    words = ["shardtune", "train", *([sweep.recipe] if sweep.recipe else []), *sweep.overrides,
             *(f"{k}={v}" for k, v in best.params.items())]
    return " ".join(shlex.quote(w) for w in words)


def write_search_outputs(sweep, search, study, key: str) -> Path:
    """`key`: the metric the search minimizes (eval_loss, eval_ppl)."""
    out = sweep.out
    rows = trial_rows(study)
    keys = [p.key for p in search.space]
    headers = ["trial", "state", "value", *keys, "last_step", "seconds", "note"]
    table = io.StringIO()
    writer = csv.DictWriter(table, headers, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(out / "search.csv", table.getvalue())
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    text = [f"# shardtune search: {key}", ""]
    if complete:
        best = study.best_trial
        text += [f"best: trial {best.number}, {key} = {fmt(best.value)}", "", "```", best_command(sweep, best), "```",
                 ""]
    else:
        text += ["no trial has finished with a value yet", ""]
    text += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    text += ["| " + " | ".join(fmt(r.get(h)) if h != "note" else str(r.get(h) or "") for h in headers) + " |"
             for r in rows]
    text += [""] + [f"![{stem}]({stem}.png)\n" for stem in draw(out, search, study, complete, key)]
    write_text_atomic(out / "search.md", "\n".join(text))  # the table a reader opens: never half of one
    print("\n".join(text[:6]), flush=True)
    return out / "search.md"


def draw(out: Path, search, study, complete: list, key: str) -> list[str]:
    """The plots there is data for; their file stems."""
    stems = []
    if complete:
        xs = [t.number for t in complete]
        ys = [t.value for t in complete]
        best = [min(ys[:i + 1]) for i in range(len(ys))]
        save_plot(out / "history.png", "Optimization history", "trial", key,
                  [("trial", "C0", "none", xs, ys), ("best so far", "C1", "-", xs, best)])
        stems.append("history")
    if len(complete) >= 2 and len(search.space) >= 1:
        try:
            import optuna

            importance = optuna.importance.get_param_importances(study)
        except Exception:  # noqa: BLE001  too few distinct trials for the estimator: no plot
            importance = {}
        if importance:
            save_bars(out / "importance.png", "Parameter importance (fANOVA)", "importance", list(importance),
                      [("importance", None, ["C0"] * len(importance), list(importance.values()))])
            stems.append("importance")
    for param in search.space:
        if param.kind == "choice":
            continue
        points = sorted((t.params[param.key], t.value) for t in complete if param.key in t.params)
        if points:
            stem = "param-" + param.key.replace(".", "_")
            save_plot(out / f"{stem}.png", f"{key} vs {param.key}", param.key, key,
                      [("trials", "C0", "-", [p[0] for p in points], [p[1] for p in points])],
                      log_x=param.kind.startswith("log"))
            stems.append(stem)
    return stems

