"""`shardtune download`: fill the Hugging Face cache for compute nodes without network."""

from __future__ import annotations

from pathlib import Path

from shardtune.cli.argtypes import fs_path, nonempty_str
from shardtune.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("download", help="fill the Hugging Face cache (for compute nodes without network)")
    p.add_argument("targets", nargs="+", metavar="TARGET", type=nonempty_str,
                   help="a recipe YAML (its model, tokenizer and "
                    "dataset), or hub ids: model:ID, dataset:ID or dataset:ID:CONFIG (a bare ID is a model)")
    p.add_argument("--cache-dir", type=fs_path, help="cache folder (default: the HF cache, $HF_HOME)")


def run(args) -> int:
    from shardtune.launch.download import download, targets_from_recipe
    from shardtune.names import hub_id

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
        if not hub_id(repo) or ":" in repo:  # (a folder here is no hub id either: the recipe names it, not this)
            raise UserError(f"download target {word!r} is not a recipe or a hub id; write model:ORG/NAME, "
                            "dataset:ORG/NAME or dataset:ORG/NAME:CONFIG")
        if (kind, repo, config_name) not in targets:
            targets.append((kind, repo, config_name))
    for (kind, repo, config_name), path in zip(targets, download(targets, args.cache_dir)):
        print(f"{kind} {repo}{':' + config_name if config_name else ''} -> {path}", flush=True)
    if args.cache_dir and targets:  # absolute: a job runs from another folder; quoted: a shell reads the line
        import shlex

        home = shlex.quote(str(Path(args.cache_dir).expanduser().resolve()))
        print(f"on machines without network: export HF_HOME={home} HF_HUB_OFFLINE=1")
    return 0
