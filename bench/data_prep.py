"""Data preparation at scale: peak RSS and throughput of `data.prepare` on synthetic jsonl corpora,
against the tokenizer's own batch-encoding throughput on the same text and cores.

For each size (default 25, 100 MB; `--sizes 25 100 400`) it writes a corpus of documents cut
from the quickstart docstrings (seeded, 200-4000 characters each) to a scratch folder, then runs,
each in a fresh process with a fresh `datasets` cache:

- `tokenizer`: the quickstart tokenizer's `tokenizer(texts)` over the corpus in chunks of 1000
  documents, timing only the calls (wall and CPU seconds, all threads): the bound;
- `prepare` (cold): `shardtune.data.pipeline.prepare` as `shardtune train` calls it (read the jsonl, hold
  out 5 %, tokenize, pack seq_len 512), with `--num-proc` workers; peak RSS covers its workers,
  CPU seconds its threads and workers;
- `prepare` (warm): the same again, on the cache the cold run left;
- with `--before SRC`, the cold `prepare` of another checkout's source folder (e.g. main's
  `src`, the in-memory packer) for comparison;
- `train` (`--runs train`): the command as a user runs it, `shardtune train data.path=CORPUS
  train.max_steps=1 eval.at_start=false eval.max_batches=1` (the quickstart's tiny model), with a
  fresh `HF_DATASETS_CACHE` and `SHARDTUNE_CACHE`; peak RSS from `/usr/bin/time -f %M`.

`--gate` (issue 37) exits 1 when peak memory grows with the corpus: for every run kind, the
largest corpus's peak over the smallest's must be at most 1.3 and the largest's at most 1.5 GB
(`.venv/bin/python bench/data_prep.py --sizes 100 400 --runs cold train --gate`, run by every
change that touches `data/`, its result in BENCHMARKS.md).

Throughput is text MB per wall second and per CPU second: on a shared machine the CPU ratio is
the one other load does not move. The corpora and caches are deleted afterwards. Results: a
markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MB, PYTHON, default_workdir, machine_line, markdown_table, quickstart_assets  # noqa: E402

WORKER = r"""
import json, resource, sys, time
mode, corpus, tokenizer_path, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(tokenizer_path)
t0, cpu0 = time.perf_counter(), time.process_time()
if mode == "tokenizer":  # wall and CPU seconds (all threads) inside the tokenizer calls only
    encode, encode_cpu, tokens, batch = 0.0, 0.0, 0, []
    def flush():
        global encode, encode_cpu, tokens
        t, c = time.perf_counter(), time.process_time()
        tokens += sum(map(len, tok(batch, add_special_tokens=False)["input_ids"]))
        encode += time.perf_counter() - t
        encode_cpu += time.process_time() - c
        batch.clear()
    with open(corpus) as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1000:
                flush()
    flush()
    out = {"seconds": encode, "cpu_seconds": encode_cpu, "tokens": tokens}
else:
    from shardtune.config.schema import DataConfig
    from shardtune.data.pipeline import prepare
    cfg = DataConfig(path=corpus, seq_len=512, num_proc=int(num_proc) or None)
    train, val = prepare(cfg, tok)
    out = {"seconds": time.perf_counter() - t0, "blocks": len(train) + (len(val) if val is not None else 0)}
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
out.update(peak_rss_mb=me.ru_maxrss / 1024, workers_peak_rss_mb=kids.ru_maxrss / 1024)
if mode != "tokenizer":  # CPU seconds of the whole preparation (threads and worker processes)
    out["cpu_seconds"] = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime - cpu0
print("RESULT " + json.dumps(out))
"""


def write_corpus(path: Path, megabytes: int, source: str, seed: int = 0) -> int:
    """Documents cut from `source` at random places, until `megabytes` of jsonl; returns the text bytes."""
    rng = random.Random(seed)
    target, written, text_bytes = megabytes * MB, 0, 0
    with open(path, "w") as f:
        while written < target:
            start = rng.randrange(len(source) - 4000)
            doc = source[start:start + rng.randint(200, 4000)]
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line.encode())
            text_bytes += len(doc.encode())
    return text_bytes


def run_worker(mode: str, corpus: Path, tokenizer: str, num_proc: int, cache: Path, src: str | None) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    if src:
        env["PYTHONPATH"] = src
    proc = subprocess.run([PYTHON, "-c", WORKER, mode, str(corpus), tokenizer, str(num_proc)], capture_output=True,
                          text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{mode} failed: {(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_train(corpus: Path, scratch: Path) -> dict:
    """Peak RSS (/usr/bin/time) and wall seconds of one `shardtune train` step on the corpus."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(scratch / "cache-train"), "SHARDTUNE_CACHE": str(scratch / "st"),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    timing = scratch / "time.txt"
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-o", str(timing), "-f", "%M %U %S", PYTHON, "-m", "shardtune", "train",
                           f"data.path={corpus}", "train.max_steps=1", "eval.at_start=false", "eval.max_batches=1",
                           f"output_dir={scratch / 'run'}"], capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode:
        raise SystemExit(f"train failed: {(proc.stderr or proc.stdout)[-2000:]}")
    peak_kb, user, system = timing.read_text().split()[-3:]
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": float(user) + float(system),
            "peak_rss_mb": int(peak_kb) / 1024, "workers_peak_rss_mb": 0, "blocks": "-"}


def gate(peaks: dict[str, dict[int, float]], ratio: float = 1.3, limit_mb: float = 1536) -> bool:
    """Prints the verdict of issue 37's gate; True when every run kind's peak is flat in corpus size."""
    ok = True
    for name, by_size in peaks.items():
        small, large = min(by_size), max(by_size)
        if small == large:
            continue
        grew = by_size[large] / by_size[small]
        fine = grew <= ratio and by_size[large] <= limit_mb
        ok &= fine
        print(f"gate {name}: {by_size[small]:.0f} MB at {small} MB, {by_size[large]:.0f} MB at {large} MB "
              f"(x{grew:.2f}; limits x{ratio}, {limit_mb:.0f} MB): {'ok' if fine else 'FAILS'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 100], help="corpus sizes in MB")
    parser.add_argument("--num-proc", type=int, default=0, help="data.num_proc (0: none, the tokenizer's threads)")
    parser.add_argument("--before", default=None, help="a source folder (e.g. /work/main/src) to compare with")
    parser.add_argument("--runs", nargs="+", choices=["tokenizer", "cold", "warm", "train"],
                        default=["tokenizer", "cold", "warm"], help="what to run (the largest corpus: only cold)")
    parser.add_argument("--gate", action="store_true", help="exit 1 if peak memory grows with the corpus (issue 37)")
    parser.add_argument("--workdir", type=Path, default=default_workdir())
    args = parser.parse_args()
    assets = quickstart_assets()
    source = "\n".join(json.loads(line)["text"] for line in open(assets["train"]))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    print(f"load average before: {os.getloadavg()[0]:.2f}; data.num_proc={args.num_proc or None}")
    headers = ["corpus MB", "run", "wall s", "CPU s", "peak RSS MB", "MB/s (wall / CPU)",
               "tokenizer MB/s (wall / CPU)", "of tokenizer, wall / CPU (target ≥ 70%)", "blocks"]
    print(markdown_table(headers, []), flush=True)  # rows follow as each size finishes
    peaks: dict[str, dict[int, float]] = {}
    for size in args.sizes:
        scratch = Path(tempfile.mkdtemp(prefix="data-prep-", dir=args.workdir))
        runs, bound = {}, None
        try:
            corpus = scratch / "corpus.jsonl"
            text_mb = write_corpus(corpus, size, source) / MB
            if "tokenizer" in args.runs:
                bound = run_worker("tokenizer", corpus, assets["tokenizer"], 0, scratch / "cache-tok", None)
            for name in ("cold", "warm"):
                if name in args.runs:
                    runs[name] = run_worker("prepare", corpus, assets["tokenizer"], args.num_proc, scratch / "cache",
                                            None)
            if args.before:
                runs["before"] = run_worker("prepare", corpus, assets["tokenizer"], args.num_proc,
                                            scratch / "cache-before", args.before)
            if "train" in args.runs:
                runs["train"] = run_train(corpus, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        bound_wall, bound_cpu = (text_mb / bound["seconds"], text_mb / bound["cpu_seconds"]) if bound else (0, 0)
        for name, r in runs.items():
            peak = max(r["peak_rss_mb"], r["workers_peak_rss_mb"])
            peaks.setdefault(name, {})[size] = peak
            wall, cpu = text_mb / r["seconds"], text_mb / r["cpu_seconds"]
            share = f"{100 * wall / bound_wall:.0f}% / {100 * cpu / bound_cpu:.0f}%" if bound else "-"
            share = "-" if name in ("warm", "train") else share
            bound_text = f"{bound_wall:.2f} / {bound_cpu:.2f}" if bound else "-"
            row = [size, name, f"{r['seconds']:.1f}", f"{r['cpu_seconds']:.1f}", f"{peak:.0f}",
                   f"{wall:.2f} / {cpu:.2f}", bound_text, share, r["blocks"]]
            print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
        print(f"{size} MB done ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    if args.gate and not gate(peaks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
