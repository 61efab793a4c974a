"""Profile shardtune's training step on a benchmark setup: one `shardtune train` run of a
`vs_hf_trainer.py` setup (the same model, data, batch and precision) with `log.profile_steps`,
its Chrome trace and operator table copied to --out, and a short summary printed.

    python bench/profile_step.py --setup gpu --out DIR              # Llama ~1B, bf16, seq 2048, CUDA
    python bench/profile_step.py --setup gpu --rehearse --out DIR   # that code path, tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_hf_trainer import SETUPS, resolve_setup, shardtune_overrides  # noqa: E402

import _common as C  # noqa: E402

TABLE_ROWS = 15  # operators shown in the summary (ops.txt keeps 40)


# the calls by which the host waits for the device: a value read (.item(), bool(tensor)), a sync
WAITS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def host_waits(trace: Path) -> dict[str, int]:
    """How often each of WAITS occurs in a Chrome trace (of the traced steps only)."""
    import gzip

    events = json.loads(gzip.decompress(trace.read_bytes())).get("traceEvents", [])
    counts = {name: sum(1 for e in events if e.get("name") == name and e.get("ph") == "X") for name in WAITS}
    return {name: n for name, n in counts.items() if n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=sorted(SETUPS), default="gpu", help="vs_hf_trainer.py's setup (default gpu)")
    p.add_argument("--out", type=Path, required=True, help="folder for trace.json.gz, ops.txt, metrics.jsonl, log")
    p.add_argument("--warmup-steps", type=int, default=3, help="untraced steps first (default 3)")
    p.add_argument("--steps", type=int, default=3, help="traced optimizer steps (default 3)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the setup's)")
    p.add_argument("--rehearse", action="store_true", help="the setup shrunk to a tiny model, on CPU")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra shardtune override")
    p.add_argument("--workdir", type=Path, default=C.default_workdir() / "profile")
    a = p.parse_args()
    if C.args_only():
        return 0

    import torch

    cuda = a.setup.startswith("gpu") and not a.rehearse
    if cuda and not torch.cuda.is_available():
        print("error: a GPU setup needs CUDA; add --rehearse for its code path on CPU", file=sys.stderr)
        return 2
    total = a.warmup_steps + a.steps
    setup = resolve_setup(a.setup, total, a.global_batch, a.rehearse)
    setup["steps"] = total  # the rehearsal's cap on steps does not apply: the window needs them
    assets = C.quickstart_assets()
    run = a.workdir / "run"
    overrides = shardtune_overrides(setup, assets["tokenizer"], str(Path(assets["train"]).parent), run, 1,
                                    "full_shard")
    overrides += [f"log.profile_steps=[{a.warmup_steps + 1},{total}]", f"device={'cuda' if cuda else 'cpu'}",
                  "save_final=false", *a.set]
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "train.log"
    with open(log, "w") as f:
        proc = subprocess.run([C.PYTHON, "-m", "shardtune", "train", *overrides, "--overwrite"], stdout=f,
                              stderr=subprocess.STDOUT, env=C.torchrun_env(1))
    for name in ("trace.json.gz", "ops.txt", "metrics.jsonl"):
        src = run / ("profile" if name != "metrics.jsonl" else "") / name
        if src.is_file():
            shutil.copy(src, a.out / name)
    print(f"# Profile of shardtune's step ({a.setup}{', rehearsal' if a.rehearse else ''})\n\n{C.machine_line()}\n\n"
          f"model {json.dumps(setup['model'])} | seq {setup['seq_len']} | micro {setup['micro']} | "
          f"global {setup['global']} | {setup['precision']} | steps {a.warmup_steps + 1}-{total} traced of {total}\n")
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode}); last lines of {log}:\n")
        print("\n".join(log.read_text().splitlines()[-15:]))
        return 1
    rows = [json.loads(line) for line in (a.out / "metrics.jsonl").read_text().splitlines()]
    times = [f"{r['step']}: {r['step_time_s']:.3f}" for r in rows if "step_time_s" in r]
    print(f"step time s (traced steps run slower): {', '.join(times)}\n")
    trace, table = a.out / "trace.json.gz", a.out / "ops.txt"
    if not (trace.is_file() and table.is_file()):
        print(f"the run wrote no profile; see {log}")
        return 1
    print(f"trace: {trace.name}, {trace.stat().st_size / C.MB:.1f} MiB (ui.perfetto.dev or chrome://tracing)\n")
    waits = host_waits(trace)
    print("host waits for the device in the traced steps, per step: "
          + (", ".join(f"{name} {n / a.steps:g}" for name, n in waits.items()) or "none")
          + ("" if cuda else " (on a CPU, kernels reading their own scalars count too: read this on a GPU)") + "\n")
    print("```\n" + "\n".join(table.read_text().splitlines()[:TABLE_ROWS + 4]) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
