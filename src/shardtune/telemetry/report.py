"""`shardtune report RUN_DIR [RUN_DIR ...]`: PNG plots and a markdown summary of one or more
runs' metrics.jsonl, several runs overlaid for comparison."""

from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError
from shardtune.fsio import atomic_dir, json_loads, refuse_foreign, whole_folder
from shardtune.telemetry.plots import fmt, plottable, save_plot

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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{str(path)!r} is not text (byte {exc.start} is not UTF-8); the file is damaged") from None
    rows, lines = [], text.splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json_loads(line)
            except ValueError:
                if n == len(lines) and not text.endswith("\n"):
                    break  # a live run's line still being written, or one a full disk cut short
                raise UserError(f"{str(path)!r} line {n} is not JSON; the file is damaged") from None
            step = row.get("step", 0) if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                raise UserError(f"{str(path)!r} line {n} is not a metrics record (a JSON object with an integer "
                                "step); the file is damaged or not shardtune's")
            rows.append(row)
    return rows


def last_step(rows: list[dict]) -> int | None:
    return max((r.get("step", 0) for r in rows), default=None)


def logged_step(run: Path) -> int | None:
    """The last step `run` logged (None: none, or no readable metrics.jsonl): the step of its
    final/, which records none itself (it is written after the run's last step)."""
    try:
        return last_step(read_metrics(run))
    except UserError:
        return None


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r.get("step", 0), r[key]) for r in rows if plottable(r.get(key)) and plottable(r.get("step", 0))]
    return [p[0] for p in points], [p[1] for p in points]


def timed_windows(rows: list[dict], skip: int = 1) -> list[tuple[dict, int, float]]:
    """(record, steps, seconds) of each log window of speed; the first `skip` (start-up: compile,
    warm caches, live-memory tracking) left out where later ones exist. A window holds the steps
    since the record before: the trainer writes one at every step a run resumes from."""
    windows, previous = [], None
    for r in rows:
        if all(plottable(r.get(k)) for k in ("step", "tokens_per_s", "step_time_s")):
            steps = r["step"] - previous if previous is not None and r["step"] > previous else 1
            windows.append((r, steps, steps * r["step_time_s"]))
            previous = r["step"]
    return windows[skip:] or windows[1:] or windows


def over_time(windows: list[tuple[dict, int, float]], key: str) -> float | None:
    """A rate or a share of the time (tokens/s, MFU, GPU use) of the windows taken together: each
    weighted by its seconds, so that tokens/s is all their tokens over all their time (a plain mean
    of the windows' rates overstates a run whose speed varies)."""
    pairs = [(r[key], seconds) for r, _, seconds in windows if plottable(r.get(key))]
    total = sum(seconds for _, seconds in pairs)
    return sum(value * seconds for value, seconds in pairs) / total if total > 0 else None


def summarize(name: str, rows: list[dict]) -> dict:
    def values(key):  # every number, inf and NaN too: a plot cannot draw them, the table says them
        return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]

    def last(key):
        found = values(key)
        return found[-1] if found else None

    ppl = values("eval_ppl")
    finite = [v for v in ppl if v == v]  # NaN is no one's best
    peaks = [v for k in ("mem_allocated_gib", "mem_rss_peak_gib") for v in series(rows, k)[1]]
    timed = timed_windows(rows)
    return {"run": name, "steps": last_step(rows) or 0,
            "final loss": last("loss"), "first eval ppl": ppl[0] if ppl else None,
            "final eval ppl": ppl[-1] if ppl else None, "best eval ppl": min(finite) if finite else None,
            "tokens/s": over_time(timed, "tokens_per_s"), "MFU": over_time(timed, "mfu"),
            "peak mem GiB": max(peaks) if peaks else None,
            # updates not applied (a non-finite step of on_nan=skip, an fp16 overflow): their loss is no trained step's
            "skipped steps": sum(1 for r in rows if r.get("skipped") is True)}


def write_report(runs: list[Path], out: Path, model_step=None) -> Path:
    """`model_step(run)`: the step of the weights a command given the run reads (checkpoint.folders.
    run_weights), which a generation.json is compared with; else (or None) the run's last logged step,
    which a killed run has no weights of: the note said to rerun eval --generate, which scored the same."""
    from shardtune.telemetry.generation_report import not_current, read_generation

    data, generations = {}, {}
    for run in runs:
        name = run.resolve().name
        while name in data or name in generations:
            name += "'"
        generated = read_generation(run)
        if generated is None or (run / "metrics.jsonl").is_file():  # a folder of eval --generate alone is fine
            data[name] = read_metrics(run)
        if generated is not None:
            step = model_step(run) if model_step else None
            note = not_current(run, generated, step if step is not None else
                               last_step(data[name]) if name in data else None)
            generations[name] = generated, note
    out = whole_folder(out, "report folder")
    refuse_foreign(out, "report folder", "a report (PNGs and report.md)",
                   lambda name: name.endswith(".png") or name == "report.md", own="report")
    with atomic_dir(out, replace=True) as tmp:  # an earlier report is replaced whole, or kept whole
        _write_report(data, generations, tmp)
    for _, note in generations.values():
        if note:  # said where it is read, too: in report.md it is one line among many
            print(f"note: {note}", flush=True)
    return out / "report.md"


def _write_report(data: dict[str, list[dict]], generations: dict[str, tuple[dict, str | None]], out: Path) -> None:
    from shardtune.telemetry.generation_report import generation_section

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
    text = ["# shardtune report", ""]
    rows = [summarize(name, metrics) for name, metrics in data.items()]
    if rows:
        headers = list(rows[0])
        text += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        text += ["| " + " | ".join(fmt(r[h]) for h in headers) + " |" for r in rows] + [""]
    text += [f"![{stem}]({stem}.png)\n" for stem in images]
    for name, (generated, note) in generations.items():
        text += generation_section(name, generated, out, note)
    (out / "report.md").write_text("\n".join(text))
