"""What `shardtune sweep` writes: OUT/sweep.csv (every trial), OUT/sweep.md (one row per grid
point) and PNG plots of throughput and memory against the micro-batch."""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path

from shardtune.fsio import write_text_atomic
from shardtune.hardware import GIB
from shardtune.telemetry.plots import fmt, save_bars, save_plot


def slug(point: dict) -> str:
    """A grid point as a file name (its trial's folder and its name in sweep.json). A name cut
    short or stripped of characters gets a hash of the point: two points whose names came out
    alike were one trial (the second reused the first's record)."""
    text = "_".join(f"{k}-{v}" for k, v in point.items()) or "recipe"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "", text.replace("=", "-").replace(",", "-"))
    if name == text and len(name) <= 150:
        return name
    digest = hashlib.sha1(json.dumps(list(point.items())).encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{name[:150]}-{digest}"


COLUMNS = ["micro_batch", "accumulation", "checkpointing", "status", "tokens_per_s", "step_time_s", "mfu",
           "mem_allocated_gib", "mem_reserved_gib", "mem_live_gib", "mem_rss_gib", "gpu_util", "predicted_gib",
           "eval_loss", "eval_ppl", "seconds", "note", "name"]


def method_label(point: dict) -> str:
    """`fsdp.sharding=no_shard precision=bf16` -> "sharding=no_shard, precision=bf16" (section
    names dropped unless two keys would read the same)."""
    short = [key.rsplit(".", 1)[-1] for key in point]
    keys = short if len(set(short)) == len(short) else list(point)
    return ", ".join(f"{k}={v}" for k, v in zip(keys, point.values())) or "recipe"


def summarize_point(point: dict, records: list[dict], best: int | None, why: str) -> dict:
    """One table row: the trial at the largest fitting micro-batch (--max-batch) or the only one."""
    if not why:  # a single trial
        record = records[0]
        note = "" if record["status"] == "ok" else f"{record['status']}: {record.get('note', '')}"
        return {"point": point, "record": record, "micro_batch": record.get("micro_batch"), "note": note}
    by_mb = {r["micro_batch"]: r for r in records}
    record = by_mb.get(best)
    misfits = sorted(mb for mb, r in by_mb.items() if r["status"] != "ok" and (best is None or mb > best))
    first_misfit = by_mb[misfits[0]] if misfits else None
    note = {"all fit": "fits up to global batch / ranks (raise train.global_batch_size to search further)",
            "none fits": "not even the smallest micro-batch fits",
            "boundary": "", "broken": "stopped: a trial crashed (not memory)"}[why]
    if first_misfit is not None:
        note = "; ".join(filter(None, [note, f"mb {first_misfit['micro_batch']}: {first_misfit['status']}"
                                       + (f" ({first_misfit['note']})" if why == "broken" else "")]))
    trials = f"{len(records)} trial{'s' if len(records) > 1 else ''}"
    return {"point": point, "record": record, "micro_batch": best, "note": f"{note}; {trials}"}


def _order(records: list[dict], points: list[dict]) -> list[dict]:
    index = {tuple(p.items()): i for i, p in enumerate(points)}
    return sorted(records, key=lambda r: (index.get(tuple(r["point"].items()), len(index)), r["micro_batch"] or 0))


def write_csv(path: Path, grid_keys: list[str], records: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*grid_keys, *COLUMNS])
        for r in records:
            writer.writerow([r["point"].get(k, "") for k in grid_keys] + [r.get(c, "") for c in COLUMNS])


def _size(gib) -> str:
    if gib is None:
        return "–"
    return f"{gib * 1024:.3g} MiB" if gib < 1 else f"{gib:.3g} GiB"


def _seconds(value) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def _peak_memory(record: dict) -> str:
    if record.get("mem_allocated_gib") is not None:
        return f"{_size(record['mem_allocated_gib'])} alloc / {_size(record.get('mem_reserved_gib'))} reserved"
    if record.get("mem_rss_gib") is not None:
        live = f"{_size(record['mem_live_gib'])} live / " if record.get("mem_live_gib") is not None else ""
        return f"{live}{_size(record['mem_rss_gib'])} RSS"
    return "–"


def markdown(sweep, summaries: list[dict], limit: int | None) -> str:
    records = [s["record"] or {} for s in summaries]
    optional = [(header, key) for header, key in [("MFU", "mfu"), ("GPU util %", "gpu_util"),
                                                  ("predicted", "predicted_gib"), ("perplexity", "eval_ppl")]
                if any(r.get(key) is not None for r in records)]
    headers = ["method", "max batch" if sweep.max_batch else "micro-batch", "accumulation", "tokens/s",
               "step time", "peak memory", *(h for h, _ in optional), "notes"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for summary, r in zip(summaries, records):
        ok = r.get("status") == "ok"
        cells = [method_label(summary["point"]), fmt(summary["micro_batch"]), fmt(r.get("accumulation")),
                 f"{r['tokens_per_s']:,.0f}" if ok and r.get("tokens_per_s") else "–",
                 _seconds(r.get("step_time_s")) if ok else "–",
                 _peak_memory(r) if ok else "–"]
        cells += [_size(r.get(key)) if key == "predicted_gib" else fmt(r.get(key)) for _, key in optional]
        lines.append("| " + " | ".join([*cells, summary["note"] or ""]) + " |")
    where = f"{sweep.nproc} {sweep.device} rank(s)" + (f", limit {_size(limit / GIB)} per rank" if limit else "")
    text = [f"# shardtune sweep: {sweep.recipe or 'quickstart'}", "",
            f"{where}; {sweep.steps} step(s) per trial; global batch kept; overrides: "
            f"{' '.join(sweep.overrides) or 'none'}.", "", *lines, ""]
    return "\n".join(text)


def write_plots(out: Path, records: list[dict], points: list[dict], limit: int | None, device: str) -> list[str]:
    """tokens/s and peak memory per grid point — against the micro-batch when trials ran at
    several, else as bars — and predicted against measured memory where there is a prediction."""
    ok = [r for r in records if r["status"] == "ok" and r.get("micro_batch")]
    groups = [(method_label(p), f"C{i % 10}", [r for r in ok if r["point"] == p]) for i, p in enumerate(points)]
    groups = [(label, color, rs) for label, color, rs in groups if rs]
    if not groups:
        return []
    memory_kinds = [("mem_reserved_gib", "reserved", "-", None), ("mem_allocated_gib", "allocated", "--", "//")] \
        if device == "cuda" else [("mem_rss_gib", "RSS", "-", None), ("mem_live_gib", "live tensors", "--", "//")]
    memory = [r[key] for _, _, rs in groups for r in rs for key, *_ in memory_kinds if r.get(key)]
    rules = [(limit / GIB, "memory limit per rank")] if limit else []
    log_memory = bool(memory) and max(memory + [y for y, _ in rules]) / min(memory) > 20
    if all(len(rs) == 1 for _, _, rs in groups):  # one micro-batch per point: bars
        names = [label.replace(", ", "\n") + f"\nmb {rs[0]['micro_batch']}" for label, _, rs in groups]
        colors = [color for _, color, _ in groups]
        save_bars(out / "throughput.png", "Throughput", "tokens / s", names,
                  [("tokens/s", None, colors, [rs[0].get("tokens_per_s") for _, _, rs in groups])])
        save_bars(out / "memory.png", "Peak memory per rank", "GiB", names,
                  [(kind, hatch, colors, [rs[0].get(key) for _, _, rs in groups])
                   for key, kind, _, hatch in memory_kinds], log_memory, rules)
    else:
        def line(label, color, style, rs, key):
            rs = [r for r in rs if r.get(key) is not None]
            return (label, color, style, [r["micro_batch"] for r in rs], [r[key] for r in rs])

        save_plot(out / "throughput.png", "Throughput", "micro-batch per rank", "tokens / s",
                  [line(label, color, "-", rs, "tokens_per_s") for label, color, rs in groups])
        save_plot(out / "memory.png", "Peak memory per rank", "micro-batch per rank", "GiB",
                  [line(f"{label} {kind}", color, style, rs, key)
                   for label, color, rs in groups for key, kind, style, _ in memory_kinds], log_memory, rules)
    images = ["throughput", "memory"]
    measured_key = "mem_allocated_gib" if device == "cuda" else "mem_live_gib"
    lines = [(label, color, "none", *zip(*pairs)) for label, color, rs in groups
             if (pairs := [(r["predicted_gib"], r[measured_key]) for r in rs
                           if r.get("predicted_gib") is not None and r.get(measured_key) is not None])]
    if lines:
        top = max(max(*xs, *ys) for *_, xs, ys in lines)
        save_plot(out / "predicted_vs_measured.png", "Predicted vs measured peak of live tensors per rank",
                  "predicted GiB (shardtune plan)", "measured GiB", [*lines, ("measured = predicted", "gray", ":",
                                                                          [0, top], [0, top])])
        images.append("predicted_vs_measured")
    return images


def write_outputs(sweep, records: list[dict], summaries: list[dict], limit: int | None) -> None:
    points = sweep.points() or [{}]
    records = _order(records, points)
    write_csv(sweep.out / "sweep.csv", [k for k, _ in sweep.grid], records)
    images = write_plots(sweep.out, records, points, limit, sweep.device)
    text = markdown(sweep, summaries, limit) + "".join(f"\n![{stem}]({stem}.png)\n" for stem in images)
    write_text_atomic(sweep.out / "sweep.md", text)  # the table a reader opens: never half of one


def describe(record: dict) -> str:
    """One line of progress per trial."""
    text = f"{record['name']}: {record['status']}"
    if record["status"] == "ok":
        text += f", {record.get('tokens_per_s', 0):,.0f} tokens/s, peak {_peak_memory(record)}"
    else:
        text += f" ({record.get('note', '')})"
    return text + f" [{record['seconds']:.0f} s]"
