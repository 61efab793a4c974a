"""The chunked LM-head loss at several chunk sizes against full logits: tokens/s, peak memory and
losses of the same fine-tune (`loss_chunk_tokens`), to choose each device's default chunk
(model/loss.py: CHUNK_BYTES, CHUNK_ALIGN) by measurement.

Arms: full (loss_chunk_tokens=0, the model's own head and loss, as HF Trainer computes it),
default (the chunk model/loss.py picks for this vocabulary and device) and one per --chunks size,
in that order --repeats times so drift hits all.

    python bench/head_chunks.py --setup cpu --steps 12 --skip 2 --chunks 125 128 256 512
                                                  # GPT-2's 50257-token vocabulary on this CPU
    python bench/head_chunks.py --chunks 1024 2048 4096
                                                  # one GPU: the Llama ~1B shape, bf16, seq 2048
    python bench/head_chunks.py --rehearse        # that code path, tiny, on CPU
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from float8_speed import arms_parser, paired_losses, run_arms, tokens_per_s  # noqa: E402

import _common as C  # noqa: E402

ARMS = {"full": ["loss_chunk_tokens=0"], "default": []}


def main() -> int:
    p = arms_parser(__doc__, ARMS, 12, "head-chunks")
    p.add_argument("--setup", choices=["cpu", "gpu", "gpu-opt"], default="gpu",
                   help="vs_hf_trainer.py's setup (default gpu: Llama ~1B)")
    p.add_argument("--chunks", type=int, nargs="*", default=[], metavar="TOKENS", help="chunk sizes to add as arms")
    a = p.parse_args()
    if C.args_only():
        return 0
    arms = {**ARMS, **{f"chunk-{n}": [f"loss_chunk_tokens={n}"] for n in a.chunks}}  # also folder names
    a.arms = [*a.arms, *(arm for arm in arms if arm not in ARMS)]
    setup, skip, tokens_per_step, runs = run_arms(a, arms, [], a.setup)
    print(f"# The chunked head loss by chunk size ({a.setup}{', rehearsal on CPU' if a.rehearse else ''})\n\n"
          f"{C.machine_line()}\n\nmodel {json.dumps(setup['model'])} | seq {setup['seq_len']} | micro "
          f"{setup['micro']} | global {setup['global']} | {setup['precision']} | {setup['steps']} steps (first "
          f"{skip} not timed) | python bench/head_chunks.py {' '.join(sys.argv[1:])}\n")
    full = next((r for r in runs.get("full", []) if "steps" in r), None)
    speed, rows = {}, []
    for arm, results in runs.items():
        done = [r for r in results if "steps" in r]
        if not done:
            rows.append([arm, "", "", "", "", "", next(r.get("refused") or r.get("error") for r in results)])
            continue
        each = [tokens_per_s(r, tokens_per_step, skip) for r in done]
        speed[arm] = statistics.median(each)
        peak = max(s.get("mem_reserved_gib", s.get("mem_rss_peak_gib", 0)) for r in done for s in r["steps"])
        rel = [abs(x - y) / abs(y) for r in done for x, y in (paired_losses(r, full) if full else [])]
        rows.append([arm, f"{speed[arm]:,.0f} ({', '.join(f'{x:,.0f}' for x in each)})",
                     f"{speed[arm] / speed['full']:.3f}x" if "full" in speed else "", f"{peak:.2f}",
                     f"{done[0]['steps'][-1]['loss']:.4f}", f"{max(rel) * 100:.3f} %" if rel else "", ""])
    print(C.markdown_table(["arm", "tok/s (median; runs)", "vs full logits", "peak GiB (reserved on CUDA, RSS on CPU)",
                            "last loss", "max relative Δloss vs full", "note"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
