"""`shardtune` command line. Imports stay lazy: `--help` must not load torch or transformers."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import EXIT_USAGE, UserError

TRAIN_EPILOG = """\
overrides are dotted config keys, e.g. train.lr=3e-5 fsdp.sharding=shard_grad_op data.seq_len=1024.
Without a recipe, runs the offline quickstart (tiny GPT-2, stdlib-docstring corpus, no download).

config keys (type = default):
"""


def _config_reference() -> str:
    from .config import reference_lines

    return "\n".join(reference_lines())


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="shardtune", description="Fine-tune Hugging Face causal LMs "
                                     "with PyTorch FSDP2 from one YAML config and one command.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="`shardtune train --help` shows the options of train.\n"
                                     + TRAIN_EPILOG + _config_reference())
    parser.add_argument("--version", action="version", version=f"shardtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="fine-tune a model (1 process, --nproc N ranks, or under torchrun/srun)",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=TRAIN_EPILOG + _config_reference())
    train.add_argument("recipe", nargs="?", help="recipe YAML (a path, or a name in ./recipes); "
                       "omit for the quickstart")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    train.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="start N local ranks with torch's elastic launcher (default: 1, or "
                            "whatever torchrun/srun started)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run already in output_dir")
    return parser


def _split_recipe(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """argparse sees `train key=value` as a recipe; put it back among the overrides."""
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        return None, [recipe, *overrides]
    if recipe is not None and not Path(recipe).exists():
        named = Path("recipes") / f"{recipe}.yaml"
        if named.is_file():
            return str(named), overrides
    return recipe, overrides


def cmd_train(args) -> int:
    from .config import load_config
    from .launch import check_nproc, launch_local, launched_by_agent

    recipe, overrides = _split_recipe(args.recipe, args.overrides)
    defaults = None
    if recipe is None:
        from .quickstart import quickstart_defaults

        defaults = quickstart_defaults()
    cfg = load_config(recipe, overrides, defaults)
    nproc = 1 if args.nproc is None else args.nproc
    if launched_by_agent() or nproc == 1:
        if args.nproc and launched_by_agent() and args.nproc != int(os.environ.get("LOCAL_WORLD_SIZE", nproc)):
            raise UserError("--nproc conflicts with the ranks torchrun/srun started; drop --nproc")
        from .train import run

        run(cfg, overwrite=args.overwrite)
        return 0
    # Parent of N local ranks: check what can be checked before starting anything.
    from .rundir import claim_output_dir, default_output_dir

    check_nproc(nproc, cfg.device)
    out = cfg.output_dir or default_output_dir(cfg.recipe)
    claim_output_dir(Path(out), args.overwrite, check_only=True)
    worker = ["train", *([recipe] if recipe else []), *overrides, f"output_dir={out}"]
    if args.overwrite:
        worker.append("--overwrite")
    return launch_local(nproc, worker)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value words after an option (`--nproc 2 train.lr=1e-3`) land in `extra`; any other
    # word there goes along too, so load_config reports it as an override that is not key=value.
    if extra and (args.command != "train" or any(w.startswith("-") for w in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return {"train": cmd_train}[args.command](args)
    except UserError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
