"""`shardtune` command line. Imports stay lazy: `--help` must not load torch or transformers."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardtune.errors import EXIT_USAGE, UserError
from shardtune.launch.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED

TRAIN_EPILOG = """\
overrides are dotted config keys, e.g. train.lr=3e-5 fsdp.sharding=shard_grad_op data.seq_len=1024.
Without a recipe, runs the offline quickstart (tiny GPT-2, stdlib-docstring corpus, no download).

config keys (type = default):
"""


def _config_reference() -> str:
    from shardtune.config.schema import reference_lines

    return "\n".join(reference_lines())


def build_parser() -> argparse.ArgumentParser:
    from shardtune import __version__

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

    export = sub.add_parser("export", help="write a plain Hugging Face folder from a sharded checkpoint")
    export.add_argument("checkpoint", help="checkpoint folder (OUTPUT_DIR/checkpoints/step-N), or a run's "
                        "output_dir for its newest checkpoint")
    export.add_argument("out", help="new folder for the model (safetensors, config, tokenizer)")
    export.add_argument("--max-shard-size", default="2GB", help="split weights into files of at most this "
                        "size (default: 2GB)")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this hub repo")
    export.add_argument("--private", action="store_true", help="create the hub repo as private")
    export.add_argument("--merge", action="store_true", help="CHECKPOINT is the final/ adapter folder of a "
                        "LoRA run: fold the adapter into the base and write a plain model")

    ev = sub.add_parser("eval", help="loss, perplexity and next-token accuracy of a model or checkpoint")
    ev.add_argument("model", help="HF folder or hub id, run folder, or checkpoint folder")
    ev.add_argument("--data", help="dataset (hub id, file or folder); default: the checkpoint's validation split")
    ev.add_argument("--data-name", help="hub dataset config name")
    ev.add_argument("--split", help="split to evaluate (default: validation, else test, else train)")
    ev.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    ev.add_argument("--seq-len", type=int, help="block length (default: the run's data.seq_len, else 512)")
    ev.add_argument("--micro-batch-size", type=int, default=8, help="sequences per rank per forward (default: 8)")
    ev.add_argument("--max-batches", type=int, default=0,
                    help="evaluate the first N x micro-batch-size sequences (default: all)")
    ev.add_argument("--compare", metavar="BASE", help="also evaluate BASE and print both side by side")
    ev.add_argument("--nproc", type=int, default=None, metavar="N", help="run on N local ranks")
    ev.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")

    gen = sub.add_parser("generate", help="generate text from a model or checkpoint")
    gen.add_argument("model", help="HF folder or hub id, run folder, or checkpoint folder")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--prompts-file", help="file with one prompt per line")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
    gen.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default: 0.9)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    rep = sub.add_parser("report", help="PNG plots and a markdown summary of one or more runs")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output folders of runs (overlaid)")
    rep.add_argument("--out", help="folder for the plots and report.md (default: RUN_DIR/report, or "
                     "./report-compare for several runs)")

    sl = sub.add_parser("slurm", help="write an sbatch script: srun + torchrun, checkpoint on preemption, requeue")
    sl.add_argument("recipe", help="recipe YAML")
    sl.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the job")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, required=True)
    sl.add_argument("--output-dir", help="the run's output_dir (default: the recipe's, else runs/<recipe>)")
    sl.add_argument("--time", default="24:00:00", help="time limit (default 24:00:00)")
    sl.add_argument("--partition")
    sl.add_argument("--account")
    sl.add_argument("--job-name")
    sl.add_argument("--signal-lead", type=int, default=300, help="seconds before the limit at which Slurm "
                    "sends SIGUSR1 to checkpoint (default 300)")
    sl.add_argument("--online", action="store_true", help="let compute nodes use the network (default: "
                    "HF_HUB_OFFLINE=1, models and data from `shardtune download`)")
    sl.add_argument("-o", "--out", help="write the script here (default: print it)")

    pl = sub.add_parser("plan", help="predict each GPU's memory (no GPU needed) and pick the fastest config that fits")
    pl.add_argument("recipe", nargs="?", help="recipe YAML (a path, or a name in ./recipes); omit for the quickstart")
    pl.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    pl.add_argument("--gpus", type=int, default=None, metavar="N", help="GPUs per node")
    pl.add_argument("--nodes", type=int, default=1, metavar="M", help="nodes (default 1)")
    pl.add_argument("--gpu", metavar="NAME", help="a GPU from the table (memory, peak FLOP/s, link), e.g. A100-80GB")
    pl.add_argument("--gpu-mem", metavar="SIZE", help="memory per GPU, e.g. 16GiB (overrides the table's)")
    pl.add_argument("--host-mem", metavar="SIZE", help="host RAM per node; candidates needing more are dropped")
    pl.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU (default: the table's)")
    pl.add_argument("--bandwidth", type=float, metavar="GB/s", help="collective bandwidth per GPU inside a node "
                    "(default: the table's NVLink/PCIe figure)")
    pl.add_argument("--inter-node-bandwidth", type=float, metavar="GB/s", help="per GPU between nodes (default 12.5)")
    pl.add_argument("--margin", type=float, default=0.05, help="share of GPU memory kept free (default 0.05)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    sw = sub.add_parser("sweep", help="short real runs over a grid of settings (sharding, precision, ...), the "
                        "largest micro-batch that fits: csv, table, plots")
    sw.add_argument("recipe", nargs="?", help="recipe YAML (omit for the quickstart)")
    sw.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every trial")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                    help="a config key and its values (repeatable: every combination is a trial)")
    sw.add_argument("--max-batch", action="store_true", help="per grid point, search the largest micro-batch "
                    "per rank that fits (the global batch stays; accumulation adjusts)")
    sw.add_argument("--steps", type=int, default=5, help="optimizer steps per trial (default: 5)")
    sw.add_argument("--eval-steps", type=int, metavar="E", help="also train E steps and record the validation "
                    "loss and perplexity then")
    sw.add_argument("--nproc", type=int, default=1, metavar="N", help="ranks per trial (default: 1)")
    sw.add_argument("--mem-limit", metavar="SIZE", help="memory per rank, e.g. 2GiB: on CPU a real cap on "
                    "each trial process; on a GPU the budget a trial must stay under (default: the GPU's memory)")
    sw.add_argument("--out", help="folder for sweep.csv, sweep.md, plots and trials (default: "
                    "runs/sweep-<recipe>); rerunning with the same folder continues the sweep")

    dl = sub.add_parser("download", help="fill the Hugging Face cache (for compute nodes without network)")
    dl.add_argument("targets", nargs="+", metavar="TARGET", help="a recipe YAML (its model, tokenizer and "
                    "dataset), or hub ids: model:ID or dataset:ID (a bare ID is a model)")
    dl.add_argument("--cache-dir", help="cache folder (default: the HF cache, $HF_HOME)")
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
    from shardtune.config.schema import load_config
    from shardtune.launch.local import check_nproc, launched_by_agent

    recipe, overrides = _split_recipe(args.recipe, args.overrides)
    defaults, used = None, None
    if recipe is None:
        from shardtune.data.quickstart import quickstart_defaults

        defaults, used = quickstart_defaults(overrides)
    cfg = load_config(recipe, overrides, defaults)
    nproc = 1 if args.nproc is None else args.nproc
    if launched_by_agent() or nproc == 1:
        if args.nproc and launched_by_agent() and args.nproc != int(os.environ.get("LOCAL_WORLD_SIZE", nproc)):
            raise UserError("--nproc conflicts with the ranks torchrun/srun started; drop --nproc")
        from shardtune.launch.local import LAUNCHER_ENV
        from shardtune.launch.signals import interrupted_line
        from shardtune.train.trainer import run

        if used and os.environ.get("RANK", "0") == "0" and LAUNCHER_ENV not in os.environ:  # else: the launcher's
            print(used, flush=True)
        try:
            results = run(cfg, overwrite=args.overwrite)
        except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
            if os.environ.get("RANK", "0") == "0":
                print(interrupted_line(cfg.output_dir), file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        return EXIT_PREEMPTED if results.get("preempted") else 0
    # Parent of N local ranks: check what can be checked before starting anything, and hold the
    # output folder for the run's lifetime (the ranks it starts share the hold).
    from shardtune.checkpoint.rundir import default_output_dir, prepare_run_dir, release_run_dir

    check_nproc(nproc, cfg.device)
    out = cfg.output_dir = cfg.output_dir or default_output_dir(cfg.recipe)
    if used:
        print(used, flush=True)
    try:
        prepare_run_dir(cfg, args.overwrite, check_only=True)
        worker = ["train", *([recipe] if recipe else []), *overrides, f"output_dir={out}"]
        if args.overwrite:
            worker.append("--overwrite")
        return _launch_preemptible(nproc, worker, Path(out))
    finally:
        release_run_dir(out)


def _launch_preemptible(nproc: int, worker: list[str], out: Path) -> int:
    """The elastic agent passes SIGTERM on to the ranks (which checkpoint and exit) but not
    SIGUSR1, so turn SIGUSR1 into SIGTERM here. A stopped run ends with EXIT_PREEMPTED only when
    the ranks wrote a checkpoint, and says which; otherwise with 128 + the signal."""
    import signal

    from shardtune.launch.local import launch_local
    from shardtune.launch.signals import marker_stamp, stop_report

    stamp = marker_stamp(out)
    previous = signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        code = launch_local(nproc, worker, interrupt_note="Ctrl-C: the ranks stop after the steps under way, with a "
                            "checkpoint once training has started; Ctrl-C again stops them at once")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    if code <= 128:
        return code
    code, line = stop_report(code - 128, out, stamp)
    print(line, file=sys.stderr)
    return code


def cmd_export(args) -> int:
    from shardtune.checkpoint.export import export_checkpoint, merge_adapter_folder, push_to_hub

    if args.merge:
        out = merge_adapter_folder(Path(args.checkpoint), Path(args.out), args.max_shard_size)
    else:
        out = export_checkpoint(args.checkpoint, Path(args.out), args.max_shard_size)
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, args.private)
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip or word.startswith("--nproc="):
            skip = False
            continue
        skip = word == "--nproc"
        if not skip:
            out.append(word)
    return out


def cmd_eval(args) -> int:
    from shardtune.launch.local import check_nproc, launch_local, launched_by_agent

    if args.nproc and args.nproc > 1 and not launched_by_agent():
        check_nproc(args.nproc, args.device)
        return launch_local(args.nproc, _without_nproc(args.argv))
    from shardtune.train.evaluate import run_eval

    run_eval(args)
    return 0


def cmd_generate(args) -> int:
    from shardtune.train.evaluate import run_generate

    run_generate(args)
    return 0


def cmd_report(args) -> int:
    from shardtune.telemetry.report import write_report

    runs = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else (runs[0] / "report" if len(runs) == 1 else Path("report-compare"))
    print(f"report written to {write_report(runs, out)}")
    return 0


def cmd_plan(args) -> int:
    from shardtune.config.schema import load_config
    from shardtune.plan.report import run_plan

    recipe, overrides = _split_recipe(args.recipe, args.overrides)
    defaults = None
    if recipe is None:
        from shardtune.data.quickstart import quickstart_defaults

        defaults = quickstart_defaults()
    cfg = load_config(recipe, overrides, defaults)
    return run_plan(args, cfg, recipe, overrides)


def cmd_slurm(args) -> int:
    from shardtune.config.schema import load_config
    from shardtune.launch.slurm import sbatch_script

    recipe, _ = _split_recipe(args.recipe, [])  # a path, or a name in ./recipes
    if recipe is None or "=" in args.recipe:
        raise UserError(f"shardtune slurm needs a recipe YAML first, got {args.recipe!r}")
    cfg = load_config(recipe, args.overrides)  # refuse a bad recipe now, not on the cluster
    out = args.output_dir or cfg.output_dir or f"runs/{cfg.recipe}"
    text = sbatch_script(recipe, out, args.nodes, args.gpus_per_node, overrides=args.overrides,
                         job_name=args.job_name, time=args.time, partition=args.partition, account=args.account,
                         signal_lead_s=args.signal_lead, offline=not args.online)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}; submit it with: sbatch {args.out}")
    else:
        print(text, end="")
    return 0


def cmd_sweep(args) -> int:
    from shardtune.hardware import parse_size
    from shardtune.sweep.grid import Sweep, parse_grid, run_sweep

    recipe, overrides = _split_recipe(args.recipe, args.overrides)
    defaults = None
    if recipe is None:
        from shardtune.data.quickstart import quickstart_defaults

        defaults = quickstart_defaults()
    sweep = Sweep(recipe, overrides, parse_grid(args.grid), steps=args.steps, eval_steps=args.eval_steps,
                  max_batch=args.max_batch, nproc=args.nproc,
                  mem_limit=parse_size(args.mem_limit, "--mem-limit") if args.mem_limit else None, defaults=defaults)
    sweep.out = Path(args.out or f"runs/sweep-{Path(recipe).stem if recipe else 'quickstart'}")
    print(f"sweep table written to {run_sweep(sweep)}")
    return 0


def cmd_download(args) -> int:
    from shardtune.launch.download import download, targets_from_recipe

    targets = []
    for word in args.targets:
        if word.endswith((".yaml", ".yml")) or (Path(word).is_file() and not word.startswith(("model:", "dataset:"))):
            found = targets_from_recipe(word)
            if not found:
                print(f"{word}: its model and data are local; nothing to download")
            targets += [t for t in found if t not in targets]
            continue
        kind, repo = ("model", word)
        if word.startswith(("model:", "dataset:")):
            kind, _, repo = word.partition(":")
        config_name = None
        if kind == "dataset" and repo.count(":") == 1:  # dataset:ID:CONFIG
            repo, config_name = repo.split(":")
        if not repo or ":" in repo:
            raise UserError(f"download target {word!r} is not a recipe or a hub id; write model:ORG/NAME, "
                            "dataset:ORG/NAME or dataset:ORG/NAME:CONFIG")
        if (kind, repo, config_name) not in targets:
            targets.append((kind, repo, config_name))
    for (kind, repo, config_name), path in zip(targets, download(targets, args.cache_dir)):
        print(f"{kind} {repo}{':' + config_name if config_name else ''} -> {path}", flush=True)
    if args.cache_dir and targets:
        print(f"on machines without network: export HF_HOME={args.cache_dir} HF_HUB_OFFLINE=1")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    args.argv = argv
    # key=value words after an option (`--nproc 2 train.lr=1e-3`) land in `extra`; any other
    # word there goes along too, so load_config reports it as an override that is not key=value.
    if extra and (args.command not in ("train", "slurm", "plan", "sweep") or any(w.startswith("-") for w in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from shardtune.launch.local import die_with_launcher

    die_with_launcher()  # a rank of `--nproc N` or torchrun: no training on after its launcher is gone
    try:
        commands = {"train": cmd_train, "plan": cmd_plan, "export": cmd_export, "eval": cmd_eval,
                    "generate": cmd_generate, "report": cmd_report, "slurm": cmd_slurm, "download": cmd_download,
                    "sweep": cmd_sweep}
        return commands[args.command](args)
    except UserError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a full disk wherever a command writes, told as one line too
        from shardtune.diskspace import no_room

        if (why := no_room(exc, 0, None)) is None:
            raise
        where = exc.filename or getattr(args, "out", None) or f"the output of `shardtune {args.command}`"
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {why} while writing {where}; free space there or write to another disk, and run again",
                  file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
