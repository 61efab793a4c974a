"""`shardtune generate`: text from a model or checkpoint."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model or checkpoint")
    p.add_argument("model", help="HF folder or hub id, run folder, or checkpoint folder")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts-file", help="file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default: 0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def run(args) -> int:
    from shardtune.train.evaluate import run_generate

    run_generate(request(args))
    return 0


def request(args):
    """The parsed flags as the library's typed request."""
    from shardtune.train.evaluate import GenerateRequest

    return GenerateRequest(model=args.model, prompts=args.prompt or [], prompts_file=args.prompts_file,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, device=args.device)
