"""What `shardtune sweep --search` leaves in its folder: search.csv (one row per trial),
search.md (the best config as a ready command line, the table of trials, the plots), and the
plots optuna.visualization.matplotlib draws: the optimization history, parameter importance,
and the objective against each numeric parameter (the learning-rate vs loss curve)."""

from __future__ import annotations

import csv
import io
import shlex
import warnings
from pathlib import Path

from shardtune.fsio import write_text_atomic
from shardtune.telemetry.plots import fmt


def trial_rows(study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        record = t.user_attrs.get("record", {})
        last_step = max(t.intermediate_values) if t.intermediate_values else None
        # failed without a record: stopped by Ctrl-C or a dead worker, not counted (search.counts)
        note = "interrupted: not counted" if t.state.name == "FAIL" and not record else record.get("note", "")
        rows.append({"trial": t.number, "state": t.state.name.lower(), "value": t.value, **t.params,
                     "last_step": last_step, "seconds": record.get("seconds"), "note": note})
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
    """The plots there is data for, drawn by optuna.visualization.matplotlib; their file stems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis

    plots = {"history": lambda: vis.plot_optimization_history(study, target_name=key)} if complete else {}
    if len(complete) >= 2 and search.space:
        plots["importance"] = lambda: vis.plot_param_importances(study)  # fANOVA, as optuna.importance
    plots.update({"param-" + p.key.replace(".", "_"): lambda k=p.key: vis.plot_slice(study, [k], target_name=key)
                  for p in search.space if p.kind != "choice" and complete})  # log axis for log parameters
    stems = []
    for stem, plot in plots.items():
        try:
            with warnings.catch_warnings(), plt.rc_context():  # optuna sets its style process-wide
                warnings.simplefilter("ignore")  # optuna's ExperimentalWarning on each plot
                fig = plot().figure
                fig.set_size_inches(7, 4)
                fig.tight_layout()
                fig.savefig(out / f"{stem}.png", dpi=110)
                plt.close(fig)
        except Exception:  # noqa: BLE001  e.g. too few distinct trials for fANOVA: no plot
            continue
        stems.append(stem)
    return stems
