"""`shardtune sweep`: a short real run per grid point; csv, table, plots."""

from __future__ import annotations

from pathlib import Path

from shardtune.cli.argtypes import nonempty_str, positive_int, ranks, size
from shardtune.cli.common import split_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="short real runs over a grid of settings (sharding, precision, ...), the "
                        "largest micro-batch that fits: csv, table, plots")
    p.add_argument("recipe", nargs="?", help="recipe YAML (omit for the quickstart)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every trial")
    p.add_argument("--grid", action="append", type=nonempty_str, default=[], metavar="KEY=V1,V2,...",
                    help="a config key and its values (repeatable: every combination is a trial)")
    p.add_argument("--max-batch", action="store_true", help="per grid point, search the largest micro-batch "
                    "per rank that fits (the global batch stays; accumulation adjusts)")
    p.add_argument("--steps", type=positive_int, default=5, help="optimizer steps per trial (default: 5)")
    p.add_argument("--eval-steps", type=positive_int, metavar="E", help="also train E steps and record the validation "
                    "loss and perplexity then")
    p.add_argument("--nproc", type=ranks, default=1, metavar="N", help="ranks per trial (default: 1)")
    p.add_argument("--mem-limit", type=size, metavar="SIZE", help="memory per rank, e.g. 2GiB: on CPU a real cap on "
                    "each trial process; on a GPU the budget a trial must stay under (default: the GPU's memory)")
    p.add_argument("--out", type=nonempty_str, help="folder for sweep.csv, sweep.md, plots and trials (default: "
                    "runs/sweep-<recipe>); rerunning with the same folder continues the sweep")


def run(args) -> int:
    from shardtune.hardware import parse_size
    from shardtune.sweep.grid import Sweep, parse_grid, run_sweep

    recipe, overrides = split_recipe(args.recipe, args.overrides)
    defaults = None
    if recipe is None:
        from shardtune.data.quickstart import quickstart_defaults

        defaults, _ = quickstart_defaults(overrides)
    sweep = Sweep(recipe, overrides, parse_grid(args.grid), steps=args.steps, eval_steps=args.eval_steps,
                  max_batch=args.max_batch, nproc=args.nproc,
                  mem_limit=parse_size(args.mem_limit, "--mem-limit") if args.mem_limit else None, defaults=defaults)
    sweep.out = Path(args.out or f"runs/sweep-{Path(recipe).stem if recipe else 'quickstart'}")
    print(f"sweep table written to {run_sweep(sweep)}")
    return 0
