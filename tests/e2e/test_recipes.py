"""Every recipe in recipes/ runs as written, offline: the model is swapped for a tiny random
model of the same architecture and the dataset for a local file with the real dataset's columns
(generated from the quickstart corpus); everything else (format, template, LoRA, wrapping,
activation checkpointing, data slice, schedule) is the recipe's own."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from conftest import ROOT, TINY, losses

RECIPES = ROOT / "recipes"

# recipe -> (hub model id, architecture of the tiny stand-in, hub dataset id, its columns)
EXPECTED = {
    "gpt2-wikitext2": ("openai-community/gpt2", "gpt2", "Salesforce/wikitext", "text"),
    "gpt2-wikitext103": ("openai-community/gpt2", "gpt2", "Salesforce/wikitext", "text"),
    "gpt2-large-wikitext103": ("openai-community/gpt2-large", "gpt2", "Salesforce/wikitext", "text"),
    "opt-1.3b-arxiv": ("facebook/opt-1.3b", "opt", "CShorten/ML-ArXiv-Papers", "arxiv"),
    "llama2-7b-lora-quotes": ("meta-llama/Llama-2-7b-hf", "llama", "Abirate/english_quotes", "quotes"),
    "llama2-7b-alpaca-lora": ("meta-llama/Llama-2-7b-hf", "llama", "yahma/alpaca-cleaned", "alpaca"),
    "llama2-7b-fsdp": ("meta-llama/Llama-2-7b-hf", "llama", "yahma/alpaca-cleaned", "alpaca"),
    "codellama-7b-chess": ("codellama/CodeLlama-7b-hf", "llama", "angeluriot/chess_games", "chess"),
}
PIECES = ["e4", "e5", "Nf3", "Nc6", "Bb5", "a6", "Ba4", "Nf6", "O-O", "Be7", "Re1", "b5", "Bb3", "d6", "c3", "O-O"]


def _docs(assets) -> list[str]:
    rows = [json.loads(line) for line in Path(assets["train"]).read_text().splitlines()]
    return [r["text"] for r in rows if r["text"].strip()]


def _rows(kind: str, docs: list[str]) -> list[dict]:
    """Rows with the columns of the real hub dataset behind `kind`."""
    if kind == "arxiv":  # CShorten/ML-ArXiv-Papers (a CSV with two index columns)
        return [{"Unnamed: 0.1": i, "Unnamed: 0": i, "title": d.split("\n")[0][:60], "abstract": d}
                for i, d in enumerate(docs)]
    if kind == "quotes":  # Abirate/english_quotes
        return [{"quote": f"“{d.split(chr(10))[0]}”", "author": f"Author {i % 7}",
                 "tags": ["life", "code"][: 1 + i % 2]} for i, d in enumerate(docs)]
    if kind == "alpaca":  # yahma/alpaca-cleaned
        return [{"instruction": d.split("\n")[0][:80], "input": "" if i % 2 else d[:40], "output": d[:200]}
                for i, d in enumerate(docs)]
    if kind == "chess":  # angeluriot/chess_games: moves_san is a list of moves
        return [{"date": "2020.01.01", "white_elo": 2400 + i, "black_elo": 2390, "end_type": "resignation",
                 "winner": "white" if i % 2 else None, "moves_san": PIECES[: 6 + i % 10],
                 "moves_uci": [], "moves_custom": [], "source": "fixture"} for i, _ in enumerate(docs)]
    raise ValueError(kind)


@pytest.fixture(scope="module")
def datasets_dir(assets, tmp_path_factory) -> dict[str, str]:
    """kind -> data.path. Wikitext is the quickstart folder itself (train + validation, `text`)."""
    root = tmp_path_factory.mktemp("recipe-data")
    docs = _docs(assets)[:160]
    paths = {"text": str(Path(assets["train"]).parent)}
    for kind in ("arxiv", "quotes", "alpaca", "chess"):
        path = root / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in _rows(kind, docs)))
        paths[kind] = str(path)
    return paths


def smoke_overrides(recipe: str, arch: str, data_path: str, tokenizer: str, out: Path) -> list[str]:
    """Swap the model and the data, shrink the run; leave the recipe's own settings alone."""
    from shardtune.config.load import load_config

    cfg = load_config(RECIPES / f"{recipe}.yaml")
    tiny = dict(TINY[arch])
    # instruct: the Alpaca prompt alone is ~150 tokens of the 300-token quickstart vocabulary
    seq_len = 256 if cfg.data.format == "instruct" else 64
    if cfg.data.format == "instruct":
        tiny["max_position_embeddings"] = seq_len
    over = {
        "model.name_or_path": "null", "model.config": json.dumps(tiny), "model.tokenizer": tokenizer,
        "data.path": data_path, "data.name": "null", "data.seq_len": seq_len, "data.num_proc": "null",
        "train.max_steps": 2, "train.micro_batch_size": 2, "train.global_batch_size": 4,
        "eval.max_batches": 1, "log.progress": "false", "log.every_steps": 1, "device": "cpu",
        "output_dir": str(out),
        # fp16 needs a GPU's loss scaling to be meaningful; bf16 runs on CPU as it is.
        "precision": "fp32" if cfg.precision == "fp16" else cfg.precision,
    }
    if cfg.data.cutoff_len:
        over["data.cutoff_len"] = seq_len
    if cfg.data.val_size >= 1:  # thousands of held-out documents: a few of the fixture's
        over["data.val_size"] = 8
    return [f"{k}={v}" for k, v in over.items()]


def test_every_reference_recipe_exists_with_real_hub_ids_and_a_header():
    """...and passes plan's check with its real model's config (the copy shipped with shardtune)
    on the GPU count its header documents: positions, peft targets, document masking, batch."""
    from shardtune.check.run import check_config
    from shardtune.config.load import check_world, load_config
    from shardtune.plan.fit import resolve_hf_config

    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED)
    for name, (model, _, dataset, _) in EXPECTED.items():
        path = RECIPES / f"{name}.yaml"
        cfg = load_config(path)
        assert (cfg.model.name_or_path, cfg.data.path) == (model, dataset), name
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        text = "\n".join(header)
        assert f"shardtune train recipes/{name}.yaml" in text, name
        assert re.search(r"\bGPUs?\b", text), f"{name}: header must say which GPUs it assumes"
        nproc = re.search(r"--nproc (\d+)", text)
        gpus = int(nproc.group(1)) if nproc else 1
        # the global batch is reachable on the documented GPU count
        assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * gpus) == 0, name
        hf_config, where = resolve_hf_config(cfg)
        assert "shipped with shardtune" in where or "cache" in where, (name, where)
        check_config(cfg, hf_config)
        assert check_world(cfg, gpus) >= 1


def test_recipes_say_what_the_reference_systems_use():
    from shardtune.config.load import load_config

    opt = load_config(RECIPES / "opt-1.3b-arxiv.yaml")
    assert (opt.precision, opt.fsdp.sharding, opt.train.max_grad_norm) == ("fp16", "full_shard", 1.0)
    assert opt.data.text_field == "abstract" and opt.data.end_idx > (opt.data.start_idx or 0)
    assert opt.train.global_batch_size == opt.train.micro_batch_size * 4 * 16  # 4 GPUs x accumulation 16

    quotes = load_config(RECIPES / "llama2-7b-lora-quotes.yaml")
    assert quotes.peft.method == "lora" and {"quote", "author"} <= set(re.findall(r"{(\w+)}", quotes.data.template))

    alpaca = load_config(RECIPES / "llama2-7b-alpaca-lora.yaml")
    assert (alpaca.data.format, alpaca.train.global_batch_size, alpaca.train.micro_batch_size) == ("instruct", 128, 4)
    assert (alpaca.train.lr, alpaca.data.cutoff_len) == (1e-4, 512)
    assert (alpaca.peft.method, alpaca.peft.r, alpaca.peft.alpha, alpaca.peft.dropout) == ("lora", 8, 16, 0.05)
    assert alpaca.peft.target_modules == ["q_proj", "v_proj"]

    full = load_config(RECIPES / "llama2-7b-fsdp.yaml")
    assert (full.peft.method, full.fsdp.wrap, full.activation_checkpointing, full.precision) == \
        ("none", "block", "full", "bf16")

    chess = load_config(RECIPES / "codellama-7b-chess.yaml")
    assert chess.fsdp.wrap == "block" and "{moves_san}" in chess.data.template and chess.data.list_sep == " "


@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_recipe_runs_offline_with_a_tiny_stand_in(recipe, assets, datasets_dir, tmp_path, capsys):
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    _, arch, _, kind = EXPECTED[recipe]
    out = tmp_path / "run"
    cfg = load_config(RECIPES / f"{recipe}.yaml",
                      smoke_overrides(recipe, arch, datasets_dir[kind], assets["tokenizer"], out))
    run(cfg, overwrite=True)
    got = losses(out)
    assert len(got) == 2 and all(math.isfinite(x) for x in got), got
    printed = capsys.readouterr().out
    if cfg.peft.method == "lora":
        assert (out / "final" / "adapter_config.json").is_file() and (out / "final" / "base").is_dir()
        assert re.search(r"trainable, [0-9.]+%", printed)
    else:
        assert (out / "final" / "config.json").is_file()
        assert "trainable, 100%" in printed  # full fine-tune: everything trains


def test_the_arxiv_recipe_on_a_small_file_names_val_size(assets, datasets_dir, tmp_path, capsys):
    """The recipe holds out 2000 abstracts; a file of 160 is refused naming data.val_size (the
    cause), not as "fewer tokens than one sequence" (its symptom), before any model is built."""
    from shardtune.cli.main import main

    words = [w for w in smoke_overrides("opt-1.3b-arxiv", "opt", datasets_dir["arxiv"], assets["tokenizer"],
                                        tmp_path / "run") if not w.startswith("data.val_size=")]
    assert main(["train", str(RECIPES / "opt-1.3b-arxiv.yaml"), *words]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.val_size=2000 holds out 2000 document(s)" in err[0], err
    assert "lower data.val_size" in err[0] and not (tmp_path / "run" / "config.yaml").exists()
