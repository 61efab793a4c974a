"""Shutdown under load: many tiny 2-rank runs at once, counting finished runs reported as crashes.

`.venv/bin/python bench/shutdown_stress.py --concurrent 4 --rounds 3` starts `--concurrent`
`shardtune train --nproc 2` runs at a time (a 1-layer GPT-2, a few steps, a checkpoint and final/),
`--rounds` times, and sorts each launch: "ok" (exit 0), "false crash" (exit != 0 although
metrics.jsonl has every step and final/ is complete: the run finished and was reported failed),
"failed" (the run really did not finish). `--src DIR` runs another checkout's shardtune (e.g.
/work/main/src, for a before/after comparison). `--abort-at-exit` makes rank 1 abort in an exit
handler after its command returned (via a sitecustomize on the ranks' path), the way a C++ thread
alive at interpreter exit does: every launch must then still end "ok", with a warning line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PYTHON, default_workdir, machine_line, markdown_table, overrides_from, quickstart_assets  # noqa: E402

STEPS = 3
ABORT_AT_EXIT = """\
import atexit, os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RUN_ID"):
    atexit.register(os.abort)  # after the command returned: as a C++ thread alive at exit would
"""


def command(out: Path) -> list[str]:
    assets = quickstart_assets(2048)
    tree = {"model": {"tokenizer": assets["tokenizer"],
                      "config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}},
            "data": {"path": assets["train"], "seq_len": 32},
            "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": STEPS, "lr": 1e-3},
            "eval": {"max_batches": 1}, "log": {"progress": False, "every_steps": 1},
            "checkpoint": {"every_steps": STEPS}, "output_dir": str(out)}
    return [PYTHON, "-m", "shardtune", "train", "--nproc", "2", *overrides_from(tree), "--overwrite"]


def finished(out: Path) -> bool:
    try:
        steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return False
    return STEPS in steps and (out / "final" / "config.json").is_file() and \
        any((out / "final").glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", help="the shardtune source tree to run (default: this checkout's)")
    parser.add_argument("--abort-at-exit", action="store_true")
    parser.add_argument("--workdir", type=Path, default=default_workdir() / "shutdown-stress")
    args = parser.parse_args()
    src = Path(args.src or Path(__file__).resolve().parents[1] / "src").resolve()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    path = [str(src)]
    if args.abort_at_exit:
        (args.workdir / "site").mkdir()
        (args.workdir / "site" / "sitecustomize.py").write_text(ABORT_AT_EXIT)
        path.insert(0, str(args.workdir / "site"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    counts, notes, start = {"ok": 0, "false crash": 0, "failed": 0}, [], time.time()
    for rnd in range(args.rounds):
        procs = []
        for i in range(args.concurrent):
            out = args.workdir / f"run-{rnd}-{i}"
            procs.append((out, subprocess.Popen(command(out), env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)))
        for out, proc in procs:
            text, _ = proc.communicate(timeout=1800)
            kind = "ok" if proc.returncode == 0 else "false crash" if finished(out) else "failed"
            counts[kind] += 1
            last = [line for line in text.splitlines() if line.startswith(("error:", "warning:"))]
            if kind != "ok" or last:
                notes.append(f"{out.name}: exit {proc.returncode} ({kind}) {last[-1] if last else ''}")
    print(machine_line())
    print(f"src {src}, {args.rounds} round(s) x {args.concurrent} concurrent 2-rank runs"
          f"{', rank 1 aborts at exit' if args.abort_at_exit else ''}, {time.time() - start:.0f} s")
    print(markdown_table(["launches", "ok", "false crash", "failed"],
                         [[sum(counts.values()), counts["ok"], counts["false crash"], counts["failed"]]]))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
