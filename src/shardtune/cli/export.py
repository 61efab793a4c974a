"""`shardtune export`: a plain Hugging Face folder from a sharded checkpoint, or a LoRA adapter merged into its base."""

from __future__ import annotations

from pathlib import Path

from shardtune.cli.argtypes import fs_path, hub_repo, nonempty_str, size_bytes
from shardtune.cli.common import only_with


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a plain Hugging Face folder from a sharded checkpoint")
    p.add_argument("checkpoint", type=nonempty_str,
                   help="checkpoint folder (OUTPUT_DIR/checkpoints/step-N), or a run's output_dir: "
                        "its final/, unless a checkpoint of a later step exists (what eval reads)")
    p.add_argument("out", type=fs_path, help="new folder for the model (safetensors, config, tokenizer)")
    p.add_argument("--max-shard-size", type=size_bytes, default="2GB", help="split weights into files of at most this "
                        "size (default: 2GB)")
    p.add_argument("--push-to-hub", metavar="REPO", type=hub_repo, help="then upload the folder to this hub repo")
    only_with(p, "--push-to-hub", [p.add_argument("--private", action="store_true",
                                                  help="create the hub repo as private")])
    p.add_argument("--merge", action="store_true", help="CHECKPOINT is the final/ adapter folder of a "
                        "LoRA run: fold the adapter into the base and write a plain model")


def run(args) -> int:
    import signal
    import sys

    from shardtune.check.run import check_export, check_push
    from shardtune.checkpoint.export import export_checkpoint, merge_adapter_folder

    if args.push_to_hub:
        check_push(args.push_to_hub)
    check_export(args.checkpoint, Path(args.out), args.merge)  # resolve -> check -> build: nothing read before
    # SIGTERM (a job's time limit, `kill`) ends the export like Ctrl-C: its partial folder is removed
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.merge:
            out = merge_adapter_folder(Path(args.checkpoint), Path(args.out), args.max_shard_size)
        else:
            out = export_checkpoint(args.checkpoint, Path(args.out), args.max_shard_size)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.push_to_hub:
        from shardtune.publish.adapter_base import export_base
        from shardtune.publish.hub import push_folder

        # a merged model has no adapter config; an adapter's names a local folder, meaningless on the Hub
        push_folder(out, args.push_to_hub, args.private, None if args.merge else export_base(args.checkpoint))
    return 0
