"""`shardtune slurm`: an sbatch script (srun + torchrun, checkpoint on Slurm's warning signal, requeue)."""

from __future__ import annotations

from pathlib import Path

from shardtune.cli.argtypes import fs_path, int_range, nonempty_str, positive_int, slurm_time
from shardtune.cli.common import split_recipe
from shardtune.errors import UserError

MARK = "# Written by `shardtune slurm`."  # in every script it writes: only those are replaced


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="write an sbatch script: srun + torchrun, checkpoint on preemption, requeue")
    p.add_argument("recipe", type=nonempty_str, help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the job")
    p.add_argument("--nodes", type=positive_int, required=True)
    p.add_argument("--gpus-per-node", type=positive_int, required=True)
    p.add_argument("--output-dir", type=fs_path,
                   help="the run's output_dir (default: the recipe's, else runs/<recipe>)")
    p.add_argument("--time", type=slurm_time, default="24:00:00", help="time limit (default 24:00:00)")
    p.add_argument("--partition", type=nonempty_str)
    p.add_argument("--account", type=nonempty_str)
    p.add_argument("--job-name", type=nonempty_str)
    # Slurm keeps the lead in 16 bits: sbatch rejects --signal=USR1@65536 and more, after the script was written
    p.add_argument("--signal-lead", type=int_range(1, 65535), default=300,
                   help="seconds before the limit at which Slurm "
                    "sends SIGUSR1 to checkpoint (default 300)")
    p.add_argument("--cpus-per-gpu", type=positive_int, default=8,
                   help="CPU cores per GPU (default 8; sbatch refuses more than a node has)")
    p.add_argument("--online", action="store_true", help="let compute nodes use the network (default: "
                    "HF_HUB_OFFLINE=1, models and data from `shardtune download`)")
    p.add_argument("-o", "--out", type=fs_path, help="write the script here (default: print it)")


def run(args) -> int:
    from shardtune.check.run import check_config_here
    from shardtune.config.load import check_job, load_config
    from shardtune.fsio import refuse_inside_run, refuse_non_folder
    from shardtune.launch.slurm import sbatch_script, shell_word

    recipe, _ = split_recipe(args.recipe, [])  # a path, or a name in ./recipes
    if recipe is None:
        raise UserError(f"shardtune slurm needs a recipe YAML first, got {args.recipe!r}")
    cfg = load_config(recipe, args.overrides)  # refuse a bad recipe now, not on the cluster
    check_job(cfg, args.nodes * args.gpus_per_node, args.gpus_per_node)  # and one the job's ranks cannot run
    check_config_here(cfg)  # and a model (where it is here) that cannot take the run: its positions, adapters
    out = args.output_dir or cfg.output_dir or f"runs/{cfg.recipe}"
    # refused as the job's train would at its start, after the queue; a link that leads nowhere here
    # may lead to the compute nodes' own disk
    option = "--output-dir" if args.output_dir else "output_dir"
    if Path(out).exists():
        refuse_non_folder(Path(out), option)
    refuse_inside_run(Path(out), option)
    text = sbatch_script(recipe, out, args.nodes, args.gpus_per_node, overrides=args.overrides,
                         job_name=args.job_name, time=args.time, partition=args.partition, account=args.account,
                         cpus_per_gpu=args.cpus_per_gpu, signal_lead_s=args.signal_lead, offline=not args.online,
                         resume=cfg.resume)
    if args.out:
        from shardtune.fsio import make_dir, refuse_foreign_file, write_text_atomic

        target = Path(args.out)
        refuse_foreign_file(target, "-o", "a script of `shardtune slurm`", MARK)
        make_dir(target.parent)  # like every other output: its folders are made
        write_text_atomic(target, text)
        print(f"wrote {args.out}; submit it with: sbatch {shell_word(args.out)}")
    else:
        print(text, end="")
    return 0
