"""`shardtune plan`: each GPU's memory before the run, and the fastest layout that fits."""

from __future__ import annotations

from shardtune.cli.argtypes import finite_float, nonempty_str, positive_float, positive_int, size
from shardtune.cli.common import split_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict each GPU's memory (no GPU needed) and pick the fastest config that fits")
    p.add_argument("recipe", nargs="?", help="recipe YAML (a path, or a name in ./recipes); omit for the quickstart")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--gpus", type=positive_int, default=None, metavar="N", help="GPUs per node")
    p.add_argument("--nodes", type=positive_int, default=1, metavar="M", help="nodes (default 1)")
    p.add_argument("--gpu", type=nonempty_str, metavar="NAME",
                   help="a GPU from the table (memory, peak FLOP/s, link), e.g. A100-80GB")
    p.add_argument("--gpu-mem", type=size, metavar="SIZE", help="memory per GPU, e.g. 16GiB (overrides the table's)")
    p.add_argument("--host-mem", type=size, metavar="SIZE",
                   help="host RAM per node; candidates needing more are dropped")
    p.add_argument("--peak-tflops", type=positive_float, help="peak TFLOP/s per GPU (default: the table's)")
    p.add_argument("--bandwidth", type=positive_float, metavar="GB/s",
                   help="collective bandwidth per GPU inside a node "
                    "(default: the table's NVLink/PCIe figure)")
    p.add_argument("--inter-node-bandwidth", type=positive_float, metavar="GB/s",
                   help="per GPU between nodes (default 12.5)")
    p.add_argument("--margin", type=finite_float(0, below=1), default=0.05,
                   help="share of GPU memory kept free (default 0.05)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from shardtune.config.load import load_config
    from shardtune.plan.report import run_plan

    recipe, overrides = split_recipe(args.recipe, args.overrides)
    defaults = None
    if recipe is None:
        from shardtune.data.quickstart import quickstart_defaults

        defaults, _ = quickstart_defaults(overrides)
    cfg = load_config(recipe, overrides, defaults)
    return run_plan(args, cfg, recipe, overrides)
