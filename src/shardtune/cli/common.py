"""What several commands share: the config reference in `--help`, a recipe named by path or name, and
options that mean something only with another."""

from __future__ import annotations

import os
from pathlib import Path

from shardtune.cli.argtypes import finite_float, non_negative_int, positive_int
from shardtune.errors import UserError

TRAIN_EPILOG = """\
overrides are dotted config keys, e.g. train.lr=3e-5 fsdp.sharding=shard_grad_op data.seq_len=1024.
Without a recipe, runs the offline quickstart (tiny GPT-2, stdlib-docstring corpus, no download).

config keys (type = default):
"""


def config_reference() -> str:
    from shardtune.config.schema import reference_lines

    return "\n".join(reference_lines())


def split_recipe(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """argparse sees `train key=value` as a recipe; put it back among the overrides."""
    if recipe is not None and "=" in recipe and not _is_path(recipe):
        return None, [recipe, *overrides]
    if recipe is not None and not _is_path(recipe):
        named = Path("recipes") / f"{recipe}.yaml"
        if named.is_file():
            return str(named), overrides
    if recipe is not None and recipe.startswith("-"):  # given after `--`: the command lines made from it (the
        recipe = os.path.join(".", recipe)  # ranks', a trial's, an sbatch script's) would read it as an option
    return recipe, overrides


def _is_path(text: str) -> bool:
    """An existing path; text too long to be one (a model.config of a few KB inline) is not."""
    try:
        return Path(text).exists()
    except OSError:  # ENAMETOOLONG
        return False


def only_with(p, flag: str, actions, given: bool = True) -> None:
    """Options (`actions`) that mean something only with `flag` (with `given=False`: only without
    it), and would be ignored the other way: `check_only_with` refuses them there in one line."""
    rules = p.get_default("only_with") or []
    needed = p._option_string_actions[flag]
    shown = flag + (f" {needed.metavar or needed.dest.upper()}" if needed.nargs != 0 else "")
    p.set_defaults(only_with=[*rules, (needed.dest, shown, [(a.option_strings[-1], a.dest, a.default)
                                                            for a in actions if a is not needed], given)])


def check_only_with(args) -> None:
    """An option given where its command ignores it (`eval --out` without `--generate`: no file
    was written), refused by the rules `only_with` declared for the command."""
    for needed, flag, options, wanted in getattr(args, "only_with", None) or ():
        if (getattr(args, needed) not in (None, False, [])) == wanted:
            continue
        used = next((opt for opt, dest, default in options if getattr(args, dest) != default), None)
        if used:
            name = flag.split()[0]
            raise UserError(f"{used} applies only with {name}; add {flag}, or drop {used}" if wanted
                            else f"{used} does nothing with {name}; drop {used}")


# the commands whose work is split over ranks (torchrun, srun, --nproc); every other is one process's
RANKED = ("train", "eval")


def check_one_process(args) -> None:
    """A command that is one process's work, started as one of several ranks (`torchrun
    --nproc_per_node 2 -m shardtune export ...`): every rank did all of it, printing its product
    once per rank and racing the others to write the same files (an export's second rank failed:
    "another process wrote there"); one line instead. torchrun's WORLD_SIZE, not Slurm's task
    count: an sbatch script's own step has one, and runs these commands alone."""
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if not world.isdigit() or int(world) <= 1 or (args.command in RANKED and getattr(args, "generate", None) is None):
        return
    what = "eval --generate" if args.command == "eval" else args.command
    raise UserError(f"shardtune {what} runs in one process, and this is one of WORLD_SIZE={world} ranks "
                    "(torchrun started it); run it without torchrun (a stray WORLD_SIZE: unset it)")


def add_decoding_args(p, temperature: float) -> None:
    """How `generate` and `eval --generate` decode."""
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens to generate per prompt (default: 64, fewer where the model's positions hold less)")
    p.add_argument("--temperature", type=finite_float(0), default=temperature,
                   help=f"0 = greedy, as is anything below 1e-5 (default: {temperature:g})")
    p.add_argument("--top-p", type=finite_float(above=0, most=1), default=0.9,
                   help="nucleus sampling mass (default: 0.9)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed (default: 0)")


def recipe_and_defaults(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str], dict | None,
                                                                           str | None]:
    """(recipe, overrides, defaults, start-up line) for every command that takes a recipe: without
    one, the quickstart's defaults (a mapping) and the line saying which of them apply."""
    recipe, overrides = split_recipe(recipe, overrides)
    if recipe is not None:
        return recipe, overrides, None, None
    from shardtune.data.quickstart import quickstart_defaults

    defaults, used = quickstart_defaults(overrides)
    return recipe, overrides, defaults, used
