"""`shardtune sweep`: a short real run per grid point, or an Optuna search (--search); csv, table, plots."""

from __future__ import annotations

from pathlib import Path

from shardtune.cli.argtypes import fs_path, non_negative_int, nonempty_str, positive_int, ranks, size
from shardtune.cli.common import only_with, recipe_and_defaults


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
                    "each trial process; on a GPU the budget a trial must stay under (default: the GPU's memory; on "
                    "CPU with --max-batch, the machine's memory over the ranks)")
    p.add_argument("--out", type=fs_path, help="folder for sweep.csv, sweep.md, plots and trials (default: "
                    "runs/sweep-<recipe>); rerunning with the same folder continues the sweep")
    s = p.add_argument_group("hyperparameter search (--search; instead of --grid)")
    s.add_argument("--search", action="append", type=nonempty_str, default=[], metavar="KEY=DIST:LOW:HIGH",
                   help="a config key and its distribution: loguniform, uniform, int, logint (LOW:HIGH) or "
                   "choice:A,B,C (repeatable), e.g. train.lr=loguniform:1e-5:1e-3")
    s.add_argument("--trials", type=positive_int, default=20,
                   help="finished trials the study should have (default: 20)")
    s.add_argument("--objective", type=nonempty_str, default="val_loss",
                   help="what to minimize: val_loss or val_ppl, the last "
                   "validation value of a trial (default: val_loss); --eval-steps E reports it every E steps to "
                   "the pruner (default: E = --steps)")
    s.add_argument("--sampler", type=nonempty_str, default="tpe", help="tpe or random (default: tpe)")
    s.add_argument("--pruner", type=nonempty_str, default="median", help="median, halving or none (default: median)")
    s.add_argument("--storage", type=nonempty_str, metavar="URL",
                   help="SQLAlchemy URL of the study's database, shared by several "
                   "machines (default: sqlite:///OUT/study.db)")
    s.add_argument("--study-name", type=nonempty_str,
                   help="the study in --storage (default: the name of the --out folder)")
    s.add_argument("--seed", type=non_negative_int, default=0, help="sampler seed (default: 0)")
    only_with(p, "--search", s._group_actions)  # ignored by a grid sweep


def run(args) -> int:
    from shardtune.hardware import parse_size
    from shardtune.sweep.grid import Sweep, parse_grid, run_sweep

    recipe, overrides, defaults, used = recipe_and_defaults(args.recipe, args.overrides)
    if used:
        print(used, flush=True)
    sweep = Sweep(recipe, overrides, parse_grid(args.grid), steps=args.steps, eval_steps=args.eval_steps,
                  max_batch=args.max_batch, nproc=args.nproc,
                  mem_limit=parse_size(args.mem_limit, "--mem-limit") if args.mem_limit else None, defaults=defaults)
    sweep.out = Path(args.out or f"runs/sweep-{Path(recipe).stem if recipe else 'quickstart'}")
    if args.search:
        from shardtune.errors import UserError
        from shardtune.sweep.search import Search, run_search
        from shardtune.sweep.space import parse_space

        if args.grid or args.max_batch:
            raise UserError("--search and --grid/--max-batch are two kinds of sweep; run them separately")
        search = Search(parse_space(args.search), trials=args.trials, objective=args.objective,
                        sampler=args.sampler, pruner=args.pruner, storage=args.storage, study_name=args.study_name,
                        seed=args.seed)
        sweep.eval_steps = sweep.eval_steps or sweep.steps
        print(f"search summary written to {run_search(sweep, search)}")
        return 0
    print(f"sweep table written to {run_sweep(sweep)}")
    return 0
