"""`shardtune plan`: each GPU's memory before the run, and the fastest layout that fits."""

from __future__ import annotations

from shardtune.cli.argtypes import finite_float, nonempty_str, positive_float, positive_int, size
from shardtune.cli.common import recipe_and_defaults


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

    recipe, overrides, defaults, used = recipe_and_defaults(args.recipe, args.overrides)
    if used:
        import sys

        print(used, file=sys.stderr, flush=True)  # stdout is the answer (--json)
    cfg = load_config(recipe, overrides, defaults)
    return run_plan(plan_request(args), cfg, recipe, overrides)


def plan_request(args):
    """The parsed flags as the library's typed request."""
    from shardtune.plan.report import PlanRequest

    return PlanRequest(gpus=args.gpus, nodes=args.nodes, gpu=args.gpu, gpu_mem=args.gpu_mem, host_mem=args.host_mem,
                       peak_tflops=args.peak_tflops, bandwidth=args.bandwidth,
                       inter_node_bandwidth=args.inter_node_bandwidth, margin=args.margin, json=args.json)
