"""`shardtune eval`: loss, perplexity and next-token accuracy of a model or checkpoint (`--nproc N` ranks);
with `--generate N`, what it generates for N prompts, scored against the references."""

from __future__ import annotations

from shardtune.cli.argtypes import fs_path, int_range, non_negative_int, nonempty_str, positive_int, ranks
from shardtune.cli.common import add_decoding_args, only_with
from shardtune.evaluation.textscores import DEFAULT_METRICS  # a light module: the CLI stays lazy


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and next-token accuracy of a model or checkpoint")
    p.add_argument("model", type=nonempty_str, help="HF folder or hub id, run folder, or checkpoint folder")
    p.add_argument("--data", type=fs_path,
                   help="dataset (hub id, file or folder); default: the checkpoint's validation split")
    p.add_argument("--data-name", type=nonempty_str, help="hub dataset config name")
    p.add_argument("--split", type=nonempty_str, help="split to evaluate (default: validation, else test, else train)")
    p.add_argument("--text-field", type=nonempty_str, default="text", help="column holding the text (default: text)")
    p.add_argument("--format", choices=["text", "instruct", "chat"], help="how the split's rows are read: packed text, "
                   "or examples scored on their responses (with --generate: prompt and reference) (default: the "
                   "run's data.format, else text)")
    seq_len = p.add_argument("--seq-len", type=int_range(2), help="block length (default: the run's data.seq_len, "
                             "else 512 or the model's maximum positions if fewer)")
    p.add_argument("--micro-batch-size", type=positive_int, default=8,
                   help="sequences per rank per forward (default: 8)")
    max_batches = p.add_argument("--max-batches", type=non_negative_int, default=0,
                    help="evaluate the first N x micro-batch-size sequences (default: all)")
    p.add_argument("--compare", metavar="BASE", type=nonempty_str,
                   help="also evaluate BASE and print both side by side")
    p.add_argument("--nproc", type=ranks, default=None, metavar="N", help="run on N local ranks")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g = p.add_argument_group("generation quality (--generate N; one process, instead of loss/perplexity)")
    g.add_argument("--generate", type=positive_int, metavar="N", help="generate for the first N prompts of the split "
                   "and score them against the references (ROUGE, BLEU, chrF) and for diversity")
    g.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="K",
                   help="text documents: the first K tokens are the prompt, the next ones the reference (default: 32, "
                   "fewer where the model's positions hold less)")
    add_decoding_args(g, temperature=0.0)
    g.add_argument("--metrics", type=nonempty_str, default=",".join(DEFAULT_METRICS),
                   help="comma-separated: rouge, bleu, chrf, diversity, mauve (default: all but mauve)")
    g.add_argument("--mauve-featurizer", type=nonempty_str, metavar="MODEL",
                   help="model whose features MAUVE compares (local "
                   "folder or an already downloaded hub id; MAUVE needs `pip install 'shardtune[mauve]'`)")
    g.add_argument("--out", type=fs_path,
                   help="JSON file for the scores and generations (default: RUN/generation.json for a "
                   "run, else ./generation.json)")
    g.add_argument("--overwrite", action="store_true", help="replace --out even if it is not an earlier output of "
                   "`eval --generate`")
    only_with(p, "--generate", g._group_actions)  # ignored by the loss/perplexity eval
    only_with(p, "--generate", [seq_len, max_batches], given=False)  # ignored by the generation eval


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
    if args.generate is not None:
        from shardtune.errors import UserError

        if args.nproc and args.nproc > 1:
            raise UserError("--generate runs in one process; drop --nproc")
        from shardtune.evaluation.quality import run_quality

        run_quality(quality_request(args))
        return 0
    from shardtune.distributed.process_group import job_ranks, launched_by_agent
    from shardtune.launch.local import launch_local

    job_ranks(args.nproc, args.device)  # checked as train checks it
    if args.nproc and args.nproc > 1 and not launched_by_agent():
        return launch_local(args.nproc, without_nproc(args.argv))
    from shardtune.evaluation.evaluate import run_eval

    run_eval(request(args))
    return 0


def request(args):
    """The parsed flags as the library's typed request."""
    from shardtune.evaluation.evaluate import EvalRequest

    return EvalRequest(model=args.model, data=args.data, data_name=args.data_name, split=args.split,
                       text_field=args.text_field, format=args.format, seq_len=args.seq_len,
                       micro_batch_size=args.micro_batch_size,
                       max_batches=args.max_batches, compare=args.compare, device=args.device)


def quality_request(args):
    """The parsed flags of `eval --generate` as the library's typed request."""
    from shardtune.evaluation.quality import QualityRequest

    return QualityRequest(model=args.model, generate=args.generate, data=args.data, data_name=args.data_name,
                          split=args.split, text_field=args.text_field, format=args.format,
                          prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                          micro_batch_size=args.micro_batch_size, metrics=args.metrics,
                          mauve_featurizer=args.mauve_featurizer, compare=args.compare, out=args.out,
                          overwrite=args.overwrite, device=args.device)
