"""The plot and number style of every report (`shardtune report`, the sweep's and the search's):
line plots, grouped bars, and numbers as table cells."""

from __future__ import annotations

import contextlib
from pathlib import Path

PLOTTABLE = 1e300  # beyond it a plot's axis margins overflow to inf (matplotlib fails on 1e308)


def plottable(value) -> bool:
    """A number a plot can draw: not a bool, NaN, inf or beyond PLOTTABLE (as a metrics.jsonl or
    generation.json edited or damaged may hold)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < PLOTTABLE


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def save_plot(path: Path, title: str, xlabel: str, ylabel: str, lines: list[tuple], log_scale: bool = False,
              rules: list[tuple[float, str]] = (), log_x: bool = False) -> None:
    """One PNG: `lines` are (label, colour, line style, xs, ys) — style "none" draws only the
    markers; `rules` are (y, label) horizontal lines such as a memory limit."""
    with _figure(path, title, xlabel, ylabel, log_scale, rules, (7, 4)) as ax:
        if log_x:
            ax.set_xscale("log")
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

    # labels are run folders, score names and grid values as written: a `$` in them is text, not
    # mathtext (`a$\x$` failed the whole report with matplotlib's parse error)
    with matplotlib.rc_context({"text.parse_math": False}):
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
