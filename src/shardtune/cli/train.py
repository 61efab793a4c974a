"""`shardtune train`: fine-tune in this process, as a rank of torchrun/srun, or as the parent of `--nproc N` ranks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardtune.cli.argtypes import ranks
from shardtune.cli.common import TRAIN_EPILOG, config_reference, recipe_and_defaults
from shardtune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model (1 process, --nproc N ranks, or under torchrun/srun)",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=TRAIN_EPILOG + config_reference())
    p.add_argument("recipe", nargs="?", help="recipe YAML (a path, or a name in ./recipes); "
                       "omit for the quickstart")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--nproc", type=ranks, default=None, metavar="N",
                       help="start N local ranks with torch's elastic launcher (default: 1, or "
                            "whatever torchrun/srun started)")
    p.add_argument("--overwrite", action="store_true",
                       help="replace the run already in output_dir")


def run(args) -> int:
    """Resolve the run, check it, then build and train it here or in `--nproc N` ranks."""
    from shardtune.check.run import check_run
    from shardtune.config.load import load_config
    from shardtune.distributed.process_group import check_agent_env, is_main_process, job_ranks, launched_by_agent
    from shardtune.resolve.run import handed_on, resolve_run

    check_agent_env()  # torchrun's or srun's variables, before anything is read, planned or written
    recipe, overrides, defaults, used = recipe_and_defaults(args.recipe, args.overrides)
    loaded = load_config(recipe, overrides, defaults)
    world, local = job_ranks(args.nproc, loaded.device)
    nproc = 1 if args.nproc is None else args.nproc
    said: list[str] = []  # what the autos chose: said after the quickstart's line, which stays the run's first
    cfg = resolve_run(loaded, world, local, say=said.append)  # the one resolved run: nothing changes it after this
    if launched_by_agent() or nproc == 1:
        from shardtune.distributed.process_group import LAUNCHER_ENV
        from shardtune.rank.preemption import interrupted_line
        from shardtune.train.trainer import run

        try:
            checked = check_run(cfg, world)  # before the process group, the model and the data
            if is_main_process():
                if used and LAUNCHER_ENV not in os.environ:  # else: the launcher's
                    print(used, flush=True)
                for line in said:
                    print(line, flush=True)
            results = run(checked, overwrite=args.overwrite)
        except KeyboardInterrupt:  # a second Ctrl-C, or one before training started (checking it too)
            if is_main_process() and LAUNCHER_ENV not in os.environ:  # else the launcher says what the ranks did
                print(interrupted_line(cfg.output_dir), file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        return EXIT_PREEMPTED if results.get("preempted") else 0
    # Parent of N local ranks: check the run before starting anything, and hold the output folder
    # for the run's lifetime (the ranks it starts share the hold). The ranks take the resolved values.
    from shardtune.checkpoint.rundir import prepare_run_dir, release_run_dir
    from shardtune.rank.preemption import interrupted_line

    out = cfg.output_dir
    for line in ([used] if used else []) + said:
        print(line, flush=True)
    try:
        prepare_run_dir(cfg, args.overwrite, check_only=True)  # cheap: a live run's folder is refused at once
        check_run(cfg, nproc, say=lambda line: None)  # one error here, not one per rank
        # the ranks take what the autos chose: planning again, each on its own reading of free RAM, could differ
        worker = ["train", *([recipe] if recipe else []), *overrides, *handed_on(cfg)]
        if args.overwrite:
            worker.append("--overwrite")
        return _launch_preemptible(nproc, worker, Path(out))
    except KeyboardInterrupt:  # Ctrl-C while checking or loading the launcher: no rank has started
        print(interrupted_line(out), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        release_run_dir(out)


def _launch_preemptible(nproc: int, worker: list[str], out: Path) -> int:
    """The elastic agent passes SIGTERM on to the ranks (which checkpoint and exit) but not
    SIGUSR1, so turn SIGUSR1 into SIGTERM here. A stopped run ends with EXIT_PREEMPTED only when
    the ranks wrote a checkpoint, and says which; otherwise with 128 + the signal."""
    import signal
    import time

    from shardtune.launch.local import launch_local
    from shardtune.launch.signals import marker_stamp, stop_report

    stamp, launched_ns = marker_stamp(out), time.time_ns()
    previous = signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        code = launch_local(nproc, worker, interrupt_note="Ctrl-C: the ranks stop after the steps under way, with a "
                            "checkpoint once training has started; Ctrl-C again stops them at once")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    if code <= 128:
        return code
    code, line = stop_report(code - 128, out, stamp, launched_ns)
    print(line, file=sys.stderr)
    return code
