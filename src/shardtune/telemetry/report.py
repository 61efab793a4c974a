"""`shardtune report RUN_DIR [RUN_DIR ...]`: PNG plots and a markdown summary of one or more
runs' metrics.jsonl, several runs overlaid for comparison."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from shardtune.errors import UserError
from shardtune.fsio import atomic_dir, refuse_foreign

# (file stem, title, y label, [(metric, line label suffix)], log scale)
PLOTS = [
    ("loss", "Loss", "mean token loss", [("loss", "train"), ("eval_loss", "validation")], False),
    ("perplexity", "Validation perplexity", "perplexity", [("eval_ppl", "")], True),
    ("throughput", "Throughput", "tokens / s", [("tokens_per_s", "")], False),
    ("mfu", "Model FLOPs utilisation", "MFU", [("mfu", "")], False),
    ("memory", "Peak memory", "GiB", [("mem_allocated_gib", "allocated"), ("mem_reserved_gib", "reserved"),
                                      ("mem_rss_peak_gib", "host RSS"), ("mem_live_peak_gib", "live tensors")], False),
    ("gpu", "GPU utilisation", "%", [("gpu_util", "")], False),
]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{str(run)!r} has no metrics.jsonl; give the output_dir of a shardtune run")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{str(path)!r} line {n} is not JSON; the file is damaged") from None
    return rows


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
              and r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def summarize(name: str, rows: list[dict]) -> dict:
    def last(key):
        values = series(rows, key)[1]
        return values[-1] if values else None

    def mean(key, skip_first: bool = True):
        values = series(rows, key)[1]
        values = values[1:] if skip_first and len(values) > 1 else values  # first interval holds start-up
        return sum(values) / len(values) if values else None

    ppl = series(rows, "eval_ppl")[1]
    peaks = [v for k in ("mem_allocated_gib", "mem_rss_peak_gib") for v in series(rows, k)[1]]
    return {"run": name, "steps": max((r.get("step", 0) for r in rows), default=0),
            "final loss": last("loss"), "first eval ppl": ppl[0] if ppl else None,
            "final eval ppl": ppl[-1] if ppl else None, "best eval ppl": min(ppl) if ppl else None,
            "tokens/s": mean("tokens_per_s"), "MFU": mean("mfu"), "peak mem GiB": max(peaks) if peaks else None}


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def save_plot(path: Path, title: str, xlabel: str, ylabel: str, lines: list[tuple], log_scale: bool = False,
              rules: list[tuple[float, str]] = ()) -> None:
    """One PNG: `lines` are (label, colour, line style, xs, ys) — style "none" draws only the
    markers; `rules` are (y, label) horizontal lines such as a memory limit."""
    with _figure(path, title, xlabel, ylabel, log_scale, rules, (7, 4)) as ax:
        for label, color, style, xs, ys in lines:
            ax.plot(xs, ys, color=color, linestyle=style, marker="o" if len(xs) < 30 else None,
                    markersize=3 if style != "none" else 5, label=label)


def save_bars(path: Path, title: str, ylabel: str, categories: list[str], bars: list[tuple], log_scale: bool = False,
              rules: list[tuple[float, str]] = ()) -> None:
    """One PNG of grouped bars: a group per category, `bars` are (label, hatch, colours, values)
    with one colour and value per category (None: no bar)."""
    width = 0.8 / max(len(bars), 1)
    with _figure(path, title, "", ylabel, log_scale, rules, (max(7.0, 2.0 * len(categories)), 4.5)) as ax:
        for j, (label, hatch, colors, values) in enumerate(bars):
            xs = [i + (j - (len(bars) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
            ax.bar(xs, [v for v in values if v is not None], width, label=label, hatch=hatch, edgecolor="black",
                   color=[c for c, v in zip(colors, values) if v is not None])
        ax.set_xticks(range(len(categories)), categories, fontsize=7)


@contextlib.contextmanager
def _figure(path: Path, title: str, xlabel: str, ylabel: str, log_scale: bool, rules, size):
    """The report's figure style around what the caller draws on the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        for y, label in rules:
            ax.axhline(y, color="black", linestyle="--", linewidth=1, label=label)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def write_report(runs: list[Path], out: Path) -> Path:
    data = {}
    for run in runs:
        name = run.resolve().name
        while name in data:
            name += "'"
        data[name] = read_metrics(run)
    refuse_foreign(out, "report folder", "a report (PNGs and report.md)",
                   lambda name: name.endswith(".png") or name == "report.md")
    with atomic_dir(out, replace=True) as tmp:  # an earlier report is replaced whole, or kept whole
        _write_report(data, tmp)
    return out / "report.md"


def _write_report(data: dict[str, list[dict]], out: Path) -> None:
    images = []
    for stem, title, ylabel, keys, log_scale in PLOTS:
        # One colour per run; train/validation (or allocated/reserved) told apart by line style.
        lines = [(f"{name}{' ' + suffix if suffix else ''}", f"C{i}", ("-", "--", ":", "-.")[j], *series(rows, key))
                 for i, (name, rows) in enumerate(data.items()) for j, (key, suffix) in enumerate(keys)]
        lines = [line for line in lines if line[3]]
        if not lines:
            continue
        save_plot(out / f"{stem}.png", title, "step", ylabel, lines, log_scale)
        images.append(stem)
    for stem, prefix, title in (("grad_norms", "grad_norm/", "Gradient norm per block (log.watch)"),
                                ("param_norms", "param_norm/", "Parameter norm per block (log.watch)")):
        # One colour per block (embeddings first, head last), one line style per run.
        lines = [(f"{name} {key.removeprefix(prefix)}", f"C{i % 10}", ("-", "--", ":", "-.")[j % 4], *series(rows, key))
                 for j, (name, rows) in enumerate(data.items())
                 for i, key in enumerate(dict.fromkeys(k for r in rows for k in r if k.startswith(prefix)))]
        if lines:
            save_plot(out / f"{stem}.png", title, "step", "L2 norm", lines, log_scale=True)
            images.append(stem)
    rows = [summarize(name, metrics) for name, metrics in data.items()]
    headers = list(rows[0])
    table = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    table += ["| " + " | ".join(fmt(r[h]) for h in headers) + " |" for r in rows]
    text = ["# shardtune report", "", *table, ""]
    text += [f"![{stem}]({stem}.png)\n" for stem in images]
    (out / "report.md").write_text("\n".join(text))
