"""`shardtune eval`: loss, perplexity and next-token accuracy of a model or checkpoint (`--nproc N` ranks)."""

from __future__ import annotations

from shardtune.cli.argtypes import int_range, non_negative_int, nonempty_str, positive_int, ranks


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and next-token accuracy of a model or checkpoint")
    p.add_argument("model", type=nonempty_str, help="HF folder or hub id, run folder, or checkpoint folder")
    p.add_argument("--data", type=nonempty_str,
                   help="dataset (hub id, file or folder); default: the checkpoint's validation split")
    p.add_argument("--data-name", type=nonempty_str, help="hub dataset config name")
    p.add_argument("--split", type=nonempty_str, help="split to evaluate (default: validation, else test, else train)")
    p.add_argument("--text-field", type=nonempty_str, default="text", help="column holding the text (default: text)")
    p.add_argument("--seq-len", type=int_range(2), help="block length (default: the run's data.seq_len, else 512)")
    p.add_argument("--micro-batch-size", type=positive_int, default=8,
                   help="sequences per rank per forward (default: 8)")
    p.add_argument("--max-batches", type=non_negative_int, default=0,
                    help="evaluate the first N x micro-batch-size sequences (default: all)")
    p.add_argument("--compare", metavar="BASE", type=nonempty_str,
                   help="also evaluate BASE and print both side by side")
    p.add_argument("--nproc", type=ranks, default=None, metavar="N", help="run on N local ranks")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip or word.startswith("--nproc="):
            skip = False
            continue
        skip = word == "--nproc"
        if not skip:
            out.append(word)
    return out


def run(args) -> int:
    from shardtune.distributed.process_group import check_nproc, launched_by_agent
    from shardtune.launch.local import launch_local

    if args.nproc and args.nproc > 1 and not launched_by_agent():
        check_nproc(args.nproc, args.device)
        return launch_local(args.nproc, without_nproc(args.argv))
    from shardtune.train.evaluate import run_eval

    run_eval(args)
    return 0
