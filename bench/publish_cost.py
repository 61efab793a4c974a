"""What publishing checkpoints to the Hub costs a run (issue 23): the same 2-rank run with and
without `publish.hub_repo`, against the local Hub server of the tests (tests/hub_server.py, so the
network is loopback and the cost is shardtune's: the export from the DCP files on rank 0's
background thread, and the client's work). Prints the step time of each run (checkpoint steps
included), the seconds each export and upload took (OUT/publish/ledger.json), and rank 0's peak RSS.

    python bench/publish_cost.py [--steps 24] [--every 6] [--layers 8] [--width 512] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import default_workdir, overrides_from, quickstart_assets, torchrun_env

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, args, publish: dict, env: dict) -> dict:
    assets = quickstart_assets()
    tree = {"model": {"tokenizer": assets["tokenizer"],
                      "config": {"model_type": "gpt2", "n_layer": args.layers, "n_embd": args.width,
                                 "n_head": 8, "n_positions": 256}},
            "data": {"path": str(Path(assets["train"]).parent), "seq_len": 128},
            "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": args.steps, "lr": 1e-4},
            "eval": {"at_start": False, "max_batches": 1}, "log": {"every_steps": 1, "progress": False},
            "checkpoint": {"every_steps": args.every, "keep_last": 0}, "output_dir": str(out), **publish}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", *overrides_from(tree), "--overwrite",
                           "--nproc", str(args.nproc)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    ckpt = {r["step"] for r in steps if r["step"] % args.every == 0}
    ledger_file = out / "publish" / "ledger.json"
    ledger = next(iter(json.loads(ledger_file.read_text()).values())) if ledger_file.exists() else {}
    return {"wall_s": wall, "step_s": statistics.median(r["step_time_s"] for r in steps if r["step"] > 1),
            "ckpt_step_s": statistics.median(r["step_time_s"] for r in steps if r["step"] in ckpt),
            "rss_gib": max(r.get("mem_rss_peak_gib", 0) for r in steps), "ledger": ledger,
            "summary": [line for line in proc.stdout.splitlines() if line.startswith("publish:")]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    work = default_workdir() / "publish_cost"
    work.mkdir(parents=True, exist_ok=True)
    port_file = work / "hub.port"
    port_file.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hub_server.py"), str(work / "hub"),
                               str(port_file)])
    try:
        while not port_file.exists():
            time.sleep(0.1)
        env = {**torchrun_env(args.nproc), "HF_ENDPOINT": f"http://127.0.0.1:{port_file.read_text()}",
               "HF_TOKEN": "bench", "HF_HOME": str(work / "hf-home"), "HF_HUB_OFFLINE": "0"}  # loopback only
        print(time.strftime("%Y-%m-%d"), vars(args))
        results = {}
        for name, publish in (("no publish", {}), ("publish", {"publish": {"hub_repo": "bench/model"}}),
                              ("no publish (again)", {})):
            results[name] = r = run(work / name.replace(" ", "-").strip("()"), args, publish, env)
            print(name, json.dumps({k: v for k, v in r.items() if k != "ledger"}))
        for item, info in results["publish"]["ledger"].items():
            print(item, info)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
