"""Every config key is priced by `plan`, refused by it in one line, or irrelevant with a reason
(plan/keys.py): a new key of the schema fails here until it is placed. QLoRA is priced."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from conftest import TINY
from shardtune.config.schema import RunConfig
from shardtune.hardware import GIB
from shardtune.plan.keys import IRRELEVANT, PRICED, REFUSED


def schema_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        sub = typing.get_type_hints(cls)[f.name]
        out += schema_keys(sub, f"{prefix}{f.name}.") if dataclasses.is_dataclass(sub) else [prefix + f.name]
    return out


def test_every_schema_key_is_priced_refused_or_irrelevant():
    keys = schema_keys()
    placed = [*PRICED, *IRRELEVANT, *(k for k in REFUSED if k not in PRICED)]
    assert sorted(placed) == sorted(keys), (sorted(set(keys) - set(placed)), sorted(set(placed) - set(keys)))
    assert not set(PRICED) & set(IRRELEVANT) and not set(REFUSED) & set(IRRELEVANT)
    assert all(reason.strip() for reason in [*PRICED.values(), *IRRELEVANT.values()])


@pytest.mark.parametrize("override, message", [
    ("eval.micro_batch_size=2", "eval.micro_batch_size is not priced by plan"),
    ("peft.quantize=4bit", "peft.quantize=4bit (QLoRA) runs on one GPU, not 4"),
])
def test_what_plan_cannot_price_is_one_line_and_exit_2(override, message, capsys):
    from shardtune.cli.main import main

    code = main(["plan", "recipes/llama2-7b-alpaca-lora.yaml", override, "--gpus", "4", "--gpu", "A10G"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: " + message) and len(err.splitlines()) == 1, err


def test_a_4bit_7b_base_is_about_4_gib():
    from shardtune.config.load import load_config
    from shardtune.plan.fit import resolve_hf_config
    from shardtune.plan.qlora import base_bytes, nf4_base

    hf_config, _ = resolve_hf_config(load_config("recipes/llama2-7b-alpaca-lora.yaml", []))
    base = nf4_base(hf_config)
    assert base["nf4_numel"] == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # every block's linears, not the head
    assert base_bytes(base) / GIB == pytest.approx(4.1, abs=0.15)


def test_plan_prices_qlora(assets, tmp_path, capsys):
    """The same LoRA recipe with and without peft.quantize=4bit on one GPU: the 4-bit answer holds
    the NF4 bytes of every linear instead of their fp32 (the rest alike), keeps the key in its
    command line, and takes only what QLoRA's run takes (no offloading, full checkpointing or none)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shardtune.cli.main import main
    from shardtune.plan.qlora import NF4_BYTES, nf4_base

    folder = tmp_path / "tiny-llama"  # QLoRA quantizes pretrained weights: a folder of them (and its tokenizer)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY["llama"], vocab_size=512)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(folder)
    args = [f"model.name_or_path={folder}", "data.path=unused", "data.seq_len=64", "train.micro_batch_size=2",
            "train.global_batch_size=4", "peft.method=lora", "precision=bf16", "--gpus", "1", "--gpu", "A10G",
            "--json"]

    def best(*extra: str) -> dict:
        assert main(["plan", *extra, *args]) == 0
        return json.loads(capsys.readouterr().out)

    lora, qlora = best(), best("peft.quantize=4bit")
    from shardtune.config.load import load_config
    from shardtune.plan.fit import resolve_hf_config

    base = nf4_base(resolve_hf_config(load_config(None, args[:6]))[0])
    saved = base["nf4_numel"] * (4 - NF4_BYTES)
    sharded = [a["best"]["gpu_bytes"]["by_category"]["sharded_params"] for a in (lora, qlora)]
    assert sharded[0] - sharded[1] == pytest.approx(saved, abs=64)
    assert "peft.quantize=4bit" in qlora["best"]["command"]
    for e in [qlora["best"], *qlora["others"]]:
        c = e["candidate"]
        assert not c["cpu_offload"] and not c["activation_offload"] and c["checkpointing"] in ("none", "full")
        assert c["reduce_dtype"] == "fp32"  # one GPU, no FSDP: nothing is reduced
