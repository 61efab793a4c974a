"""Single-process training runs (in this process): architectures, precisions, outputs."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import ROOT, run_cli, tiny_overrides
from conftest import train_tiny as train
from shardtune.config.load import load_config
from shardtune.config.schema import TrainConfig
from shardtune.train.optim import lr_factor


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_each_architecture_trains_and_its_loss_falls(assets, tmp_path, arch):
    got = train(assets, tmp_path, arch=arch, **{"train.max_steps": 10, "train.lr": 3e-3})
    assert len(got) == 10 and all(math.isfinite(x) for x in got)
    assert sum(got[-3:]) / 3 < got[0] - 0.1, got


@pytest.mark.parametrize("extra", [
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"fsdp.cpu_offload": "true", "activation_checkpointing": "true"},
], ids=["bf16", "fp16-scaler", "offload+ac"])
def test_precisions_and_offload_train_on_cpu(assets, tmp_path, extra):
    got = train(assets, tmp_path, **{"train.max_steps": 6, "train.lr": 3e-3, **extra})
    assert all(math.isfinite(x) for x in got) and got[-1] < got[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if extra.get("precision") == "fp16":
        assert all(r["loss_scale"] > 0 for r in rows if "loss" in r)


def test_each_step_records_its_own_loss_scale(assets, tmp_path, monkeypatch):
    """A scale of 2**40 overflows fp16's gradients: every step is skipped and halves it. A record
    showed the scale of the step after it (the host reads a step once the next has run)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import shardtune.train.optim as optim

    monkeypatch.setattr(optim, "build_grad_scaler", lambda precision, device: ShardedGradScaler(
        device=device.type, init_scale=2.0 ** 40))
    train(assets, tmp_path, **{"precision": "fp16", "train.max_steps": 3, "data.val_size": 0, "save_final": "false"})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_scale"] for r in rows if "loss" in r] == [2.0 ** 39, 2.0 ** 38, 2.0 ** 37]


def test_run_folder_holds_resolved_config_metrics_and_hf_export(assets, tmp_path):
    train(assets, tmp_path, **{"train.max_steps": 4, "log.every_steps": 2})
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == 4 and cfg["fsdp"]["sharding"] == "full_shard"
    again = load_config(tmp_path / "config.yaml")  # the resolved config is a valid recipe
    assert again.data.seq_len == 64
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, *logged = rows
    assert first["step"] == 0 and "eval_loss" in first and "eval_ppl" in first
    assert [r["step"] for r in logged] == [2, 4]
    for key in ("epoch", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "eval_loss", "eval_ppl"):
        assert key in logged[-1], key
    assert logged[-1]["tokens_seen"] == 4 * 8 * 64
    assert math.isclose(logged[-1]["eval_ppl"], math.exp(logged[-1]["eval_loss"]))
    final = tmp_path / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
    assert (final / "tokenizer.json").exists() and (final / "generation_config.json").exists()


def test_loss_is_the_token_mean_a_plain_forward_computes(assets, tmp_path):
    """The first logged loss equals transformers' own mean token loss on the same global batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.config.load import load_config as load
    from shardtune.data.batches import BatchPlan
    from shardtune.data.pipeline import prepare
    from shardtune.model.hf import load_hf_config, load_source_model, load_tokenizer

    cfg = load(None, tiny_overrides(assets, tmp_path, **{"train.max_steps": 1}), defaults={})
    got = train(assets, tmp_path, **{"train.max_steps": 1})[0]
    tok = load_tokenizer(cfg.model)
    hf_config = load_hf_config(cfg.model)
    hf_config.vocab_size = len(tok)
    model = load_source_model(cfg.model, hf_config, cfg.train.seed)
    assert isinstance(model, AutoModelForCausalLM._model_mapping[type(hf_config)])
    train_ds, _ = prepare(cfg.data, tok)
    plan = BatchPlan(len(train_ds), 8, 8, 1, 0, cfg.train.seed)
    ids = train_ds[plan.micro_batches(0, 0)[0]]["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert abs(got - expected) < 1e-5


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, 100, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(10, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(55, 100, cfg) == pytest.approx(0.55)
    assert lr_factor(100, 100, cfg) == pytest.approx(0.1)
    cfg.lr_schedule = "linear"
    assert lr_factor(55, 100, cfg) == pytest.approx(0.55)
    cfg.lr_schedule = "constant"
    assert lr_factor(80, 100, cfg) == 1.0


@pytest.mark.parametrize("arch, method", [("gpt2", "none"), ("gpt_oss", "none"), ("gpt2", "ia3"),
                                          *(("llama", m) for m in ("lora", "dora", "ia3", "adaption_prompt",
                                                                    "prefix_tuning", "prompt_tuning"))])
def test_weight_decay_is_hf_trainers_less_the_vectors_for_every_method(arch, method):
    """Decayed: what Hugging Face Trainer decays (not named a bias or a norm), less the vectors (at
    most one dimension longer than 1): IA3's (n, 1) scales were decayed towards 0, and gpt-oss's
    experts' (experts x width) biases decayed; DoRA's magnitudes, the adaption gate and gpt-oss's
    sinks are vectors HF decays. One decayed group, one not, each at train.lr."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter
    from shardtune.train.optim import build_optimizer

    sys.path.insert(0, str(ROOT / "tests"))
    from archs import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(arch))
    if method != "none":
        model = add_adapter(model, PeftConfig(method=method, dropout=0.0 if method in ("lora", "dora") else 0.05))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    expected = {n for n in Trainer.get_decay_parameter_names(None, model) if n in trained
                and sum(side > 1 for side in trained[n].shape) > 1}
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    names = {id(p): n for n, p in trained.items()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    assert decayed == expected, (arch, method, sorted(decayed ^ expected))
    groups = [(0.1, 3e-4)] * bool(expected) + [(0.0, 3e-4)] * (len(expected) < len(trained))
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == groups
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trained)


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_quickstart_runs_offline_and_halves_perplexity(tmp_path):
    """`shardtune train` with no recipe (shortened to 30 steps: 2051 -> 578 when written): builds its own
    corpus and tokenizer offline."""
    proc = run_cli(["train", "train.max_steps=30", "eval.every_steps=0", f"output_dir={tmp_path / 'qs'}"],
                   env={"SHARDTUNE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("validation perplexity"))
    before, after = (float(w) for w in line.replace("->", " ").split() if w.replace(".", "").isdigit())
    assert after <= before / 2, line


def compiled_against_eager(assets, out, monkeypatch, steps: int, **extra) -> None:
    """Train eager, then with compile=true: the losses agree, and the graphs dynamo holds after the
    first step are all it ever makes (a recompiling step would cost seconds every step)."""
    import torch
    from torch._dynamo.utils import counters

    import shardtune.train.trainer as trainer_mod

    eager = train(assets, out / "eager", **{"train.max_steps": steps, **extra})
    graphs, real_step = [], trainer_mod.train_step

    def counted_step(*args, **kw):
        result = real_step(*args, **kw)
        graphs.append(counters["stats"]["unique_graphs"])
        return result

    monkeypatch.setattr(trainer_mod, "train_step", counted_step)
    torch._dynamo.reset()  # what another test compiled in this process is not counted here
    counters.clear()
    compiled = train(assets, out / "compiled", **{"train.max_steps": steps, "compile": "true", **extra})
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-4, (eager, compiled)
    assert graphs[0] >= 1 and graphs == graphs[:1] * steps and not counters["recompiles"], (graphs, counters)


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_compile_per_block_matches_eager_and_never_recompiles(assets, tmp_path, monkeypatch):
    """Packed text: every micro-batch the same shape."""
    compiled_against_eager(assets, tmp_path, monkeypatch, 4)


@pytest.mark.early  # tens of seconds: run first (conftest)
def test_compiled_blocks_take_padded_batches_of_any_length_without_recompiling(assets, tmp_path, monkeypatch):
    """compile=auto compiles on every CUDA run, and most fine-tunes pad each micro-batch to its
    longest example: the lengths change every micro-batch. What dynamo makes in the first step (a
    graph for the first length, one with the length left dynamic) is all it makes."""
    from conftest import spread_alpaca

    compiled_against_eager(assets, tmp_path, monkeypatch, 5, arch="llama", **{
        "data.path": str(spread_alpaca(tmp_path / "alpaca.jsonl")), "data.format": "instruct", "data.seq_len": 128,
        "data.val_size": 0, "save_final": "false"})


@pytest.mark.parametrize("fmt,method", [("chat", "none"), ("text", "none"), ("chat", "lora")])
def test_final_and_export_stop_generation_where_training_taught_replies_to_end(assets, tmp_path, fmt, method):
    """A base model whose generation config stops at another token than the ends its run labels
    (the tokenizer's EOS after each text document; in chat, the template's end of turn: a base's
    <|endoftext|> under ChatML): final/ and the export of a checkpoint kept the base's EOS alone, so
    transformers' generate on them ran past every reply. Both now carry every trained end; an
    adapter too, and its merge into a base that is not copied beside it (a hub model). An
    hf_format checkpoint is such a folder too, with its tokenizer beside the weights (it had none
    there: AutoTokenizer.from_pretrained(checkpoints/step-N) failed)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from conftest import TINY
    from shardtune.checkpoint.export import merge_adapter_folder, write_export
    from shardtune.data.chat import trained_ends
    from shardtune.resolve.run import resolve_machine
    from shardtune.train.trainer import run

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    base, other = tmp_path / "base", 7  # the base's own stop: no token the run's labels end with
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY["llama"], "vocab_size": len(tok)}))
    model.generation_config = GenerationConfig(eos_token_id=other, bos_token_id=tok.bos_token_id)
    model.save_pretrained(base)
    tok.save_pretrained(base)
    data = {}
    if fmt == "chat":
        rows = [{"messages": [{"role": "user", "content": "the of and " * (i % 4 + 1)},
                              {"role": "assistant", "content": "to in is " * (i % 3 + 1)}]} for i in range(24)]
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = {"data.format": "chat", "data.path": str(tmp_path / "chat.jsonl"), "data.val_size": 4}
    overrides = [o for o in tiny_overrides(assets, tmp_path / "run", **{
        "train.max_steps": 1, "eval.max_batches": 1, "checkpoint.every_steps": 1, "peft.method": method,
        "checkpoint.hf_format": str(method == "none").lower(), **data})
        if not o.startswith(("model.config=", "model.tokenizer="))] + [f"model.name_or_path={base}"]
    train_config = load_config(None, overrides, defaults={})
    ends = {e for e in trained_ends(train_config.data, tok) if isinstance(e, int)}
    assert ends == ({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} if fmt == "chat" else
                    {tok.eos_token_id})
    run(resolve_machine(train_config), overwrite=True)
    write_export(next((tmp_path / "run" / "checkpoints").glob("step-*")), tmp_path / "export")
    folders = [tmp_path / "run" / "final", tmp_path / "export"]
    if method == "none":
        folders.append(checkpoint := next((tmp_path / "run" / "checkpoints").glob("step-*")))
        assert AutoTokenizer.from_pretrained(checkpoint).get_vocab() == tok.get_vocab()
    if method != "none":  # the adapter on the base as a hub id names it (no copy of its own)
        adapter_config = folders[0] / "adapter_config.json"
        adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()),
                                              "base_model_name_or_path": str(base)}))
        folders.append(merge_adapter_folder(folders[0], tmp_path / "merged"))
    for folder in folders:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        assert set(eos if isinstance(eos, list) else [eos]) == {other, *ends}, (folder, eos)
