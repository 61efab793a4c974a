"""`shardtune generate`: text from a model or checkpoint."""

from __future__ import annotations

from shardtune.cli.argtypes import nonempty_str, positive_int, regular_file
from shardtune.cli.common import add_decoding_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model or checkpoint")
    p.add_argument("model", type=nonempty_str, help="HF folder or hub id, run folder, or checkpoint folder")
    p.add_argument("--prompt", action="append", type=nonempty_str, help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=regular_file, help="file with one prompt per line")
    add_decoding_args(p, temperature=0.7)
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="prompts per generate call, left-padded (default: 8)")
    p.add_argument("--format", choices=["text", "instruct", "chat"], help="how each prompt is laid out: as given "
                   "(text), as the instruction of an instruct example, or as a user turn of a chat (default: the "
                   "run's data.format, else text)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def run(args) -> int:
    from shardtune.evaluation.evaluate import run_generate

    run_generate(request(args))
    return 0


def request(args):
    """The parsed flags as the library's typed request."""
    from shardtune.evaluation.evaluate import GenerateRequest

    return GenerateRequest(model=args.model, prompts=args.prompt or [], prompts_file=args.prompts_file,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, batch_size=args.batch_size, format=args.format,
                           device=args.device)
