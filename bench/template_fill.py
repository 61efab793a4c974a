"""What `data.template` costs per row beside tokenizing it: `formats.fill` (the cells formatted as
they are: list items, record fields) against plain `str.format_map` over the cells made text (how
it rendered before session 17), and the quickstart tokenizer's batch encoding of the same rows.

    .venv/bin/python bench/template_fill.py [--rows 50000]

Prints microseconds per row of each; the share of tokenizing is what data preparation feels.
"""

from __future__ import annotations

import argparse
import time


def per_row_us(fn, rows: list) -> float:
    start = time.perf_counter()
    fn(rows)
    return 1e6 * (time.perf_counter() - start) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50000)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from shardtune.data.formats import as_text, fill
    from shardtune.data.quickstart import build_quickstart_assets, default_cache_dir

    rows = [{"title": f"title {i}", "body": "some words here " * 10, "n": i, "tags": ["a", "b"]}
            for i in range(args.rows)]
    tokenizer = AutoTokenizer.from_pretrained(build_quickstart_assets(default_cache_dir())["tokenizer"])
    # whole cells (most templates: str.format's own path), and one that indexes a list cell (the cell formatter)
    for template in ("## {title}\n\n{body} ({n})", "## {title}\n\n{body} ({n}) {tags[0]}"):
        new = per_row_us(lambda rs, t=template: [fill(t, r) for r in rs], rows)
        old = per_row_us(lambda rs, t=template: [t.format_map({k: as_text(v, " ") for k, v in r.items()})
                                                 for r in rs], rows)
        texts = [fill(template, r) for r in rows]
        tokens = per_row_us(lambda ts: [tokenizer(ts[i:i + 1000]) for i in range(0, len(ts), 1000)], texts)
        print(f"{template!r}, {args.rows} rows: fill {new:.2f} us/row, str.format_map {old:.2f} us/row, tokenize "
              f"{tokens:.2f} us/row; fill is {new / tokens:.0%} of tokenizing (format_map {old / tokens:.0%})")

if __name__ == "__main__":
    main()
