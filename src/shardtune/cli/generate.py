"""`shardtune generate`: text from a model or checkpoint."""

from __future__ import annotations

from shardtune.cli.argtypes import finite_float, non_negative_int, nonempty_str, positive_int, regular_file


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model or checkpoint")
    p.add_argument("model", type=nonempty_str, help="HF folder or hub id, run folder, or checkpoint folder")
    p.add_argument("--prompt", action="append", type=nonempty_str, help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=regular_file, help="file with one prompt per line")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=finite_float(0), default=0.7, help="0 = greedy (default: 0.7)")
    p.add_argument("--top-p", type=finite_float(above=0, most=1), default=0.9,
                   help="nucleus sampling mass (default: 0.9)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def run(args) -> int:
    from shardtune.train.evaluate import run_generate

    run_generate(args)
    return 0
