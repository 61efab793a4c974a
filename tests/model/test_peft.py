"""LoRA (peft), QLoRA refusal without a GPU, layer freezing, and the adapter's final/ folder:
loadable by peft as it is, and `shardtune export --merge` folds it into a plain model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from archs import arch_config

from conftest import TINY, losses, run_cli, tiny_overrides

LORA = {"peft.method": "lora", "peft.dropout": 0.0, "train.lr": 1e-2}
PROBE_LEN = 16


def _probe():
    import torch

    return (torch.arange(2 * PROBE_LEN).reshape(2, PROBE_LEN) * 7) % 250


def _full_state(model) -> dict:
    from shardtune.checkpoint.export import gather_full_state_dict

    return {k: v.detach().clone() for k, v in gather_full_state_dict(model).items()}


@pytest.fixture(scope="module")
def lora_run(assets, tmp_path_factory):
    """A 3-step GPT-2 LoRA run through Trainer: its stdout, weights before/after, logits, final/."""
    import contextlib
    import io

    import torch

    from shardtune.config.load import load_config
    from shardtune.train.trainer import Trainer

    out = tmp_path_factory.mktemp("lora")
    cfg = load_config(None, tiny_overrides(assets, out, **LORA, **{"train.max_steps": 3, "eval.max_batches": 1,
                                                                   "checkpoint.every_steps": 3}),
                      defaults={})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = Trainer(cfg, overwrite=True)
        before = _full_state(trainer.model)
        trainer.fit()
        after = _full_state(trainer.model)
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(input_ids=_probe()).logits.detach().clone()
        final = trainer.export()
        trainer.close()
    return {"out": out, "final": final, "stdout": printed.getvalue(), "before": before, "after": after,
            "trainable": trainable, "logits": logits}


def test_lora_trains_only_the_adapters_and_prints_the_trainable_share(lora_run):
    line = next(line for line in lora_run["stdout"].splitlines() if "trainable" in line)
    share = float(re.search(r"trainable, ([0-9.]+)%", line).group(1))
    assert "PeftModel" in line and 0 < share < 10, line
    assert lora_run["trainable"] and all("lora_" in n for n in lora_run["trainable"])
    assert any("c_attn" in n for n in lora_run["trainable"])  # GPT-2's default target
    before, after = lora_run["before"], lora_run["after"]
    import torch

    for name in before:
        changed = not torch.equal(before[name], after[name])
        if "lora_" in name:
            assert changed, f"adapter {name} did not train"
        else:
            assert not changed, f"frozen base weight {name} changed"
    assert len(losses(lora_run["out"])) == 3


def test_adapter_folder_loads_with_peft_and_merges_to_a_plain_model(lora_run, tmp_path):
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.cli.main import main

    final = Path(lora_run["final"])
    assert (final / "adapter_model.safetensors").is_file() and (final / "base" / "config.json").is_file()
    config = json.loads((final / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (final / "base").resolve()
    assert config["target_modules"] == ["c_attn"] or set(config["target_modules"]) == {"c_attn"}

    probe = _probe()
    pair = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(final / "base"), final).eval()
    auto = AutoPeftModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        pair_logits, auto_logits = pair(input_ids=probe).logits, auto(input_ids=probe).logits
    assert (pair_logits - lora_run["logits"]).abs().max() < 1e-5  # what was trained is what was saved
    assert (auto_logits - pair_logits).abs().max() < 1e-6

    merged_dir = tmp_path / "merged"
    assert main(["export", str(final), str(merged_dir), "--merge"]) == 0
    assert not list(merged_dir.glob("adapter_*"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert (merged(input_ids=probe).logits - pair_logits).abs().max() < 1e-5
    assert (merged_dir / "tokenizer.json").is_file()


def test_merge_finds_the_base_beside_a_moved_adapter_and_refuses_bad_folders(lora_run, tmp_path, capsys):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.cli.main import main

    moved = tmp_path / "copied-final"
    shutil.copytree(lora_run["final"], moved)
    cfg_path = moved / "adapter_config.json"
    config = json.loads(cfg_path.read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone" / "base")  # as on another machine
    cfg_path.write_text(json.dumps(config))
    assert main(["export", str(moved), str(tmp_path / "m"), "--merge"]) == 0
    pair = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moved / "base"), moved).eval()
    with torch.no_grad():
        diff = (AutoModelForCausalLM.from_pretrained(tmp_path / "m")(input_ids=_probe()).logits
                - pair(input_ids=_probe()).logits).abs().max()
    assert diff < 1e-5
    capsys.readouterr()

    # a run folder stands for its final/; a full (non-LoRA) folder and a used target are refused
    assert main(["export", str(lora_run["out"]), str(tmp_path / "m2"), "--merge"]) == 0
    for args in ([str(moved / "base"), str(tmp_path / "m3")], [str(moved), str(tmp_path / "m")]):
        capsys.readouterr()
        assert main(["export", *args, "--merge"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("damage, words", [
    (lambda d: _edit_adapter_config(d, r=16), ["does not fit its base", "size mismatch"]),
    (lambda d: _edit_adapter_config(d, target_modules=["nope"]), ["does not fit its base", "nope"]),
    (lambda d: _edit_adapter_config(d, peft_type="NOPE"), ["peft_type='NOPE'"]),
    # a type peft knows and shardtune does not load: export --merge said "use the adapter folder as it is"
    (lambda d: _edit_adapter_config(d, peft_type="LOHA"), ["peft_type LOHA is not one shardtune loads"]),
    (lambda d: (d / "adapter_model.safetensors").unlink(), ["has no adapter_model.safetensors"]),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10"), ["truncated or damaged"]),
])
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_damaged_adapter_folder_is_one_line(lora_run, tmp_path, capsys, damage, words, command):
    """peft's and torch's errors (a size mismatch, an unknown type, a missing file) escaped as tracebacks."""
    from shardtune.cli.main import main

    folder = tmp_path / "final"
    shutil.copytree(lora_run["final"], folder)
    damage(folder)
    argv = {"generate": ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"],
            "export": ["export", str(folder), str(tmp_path / "merged"), "--merge"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err


def _edit_adapter_config(folder, **values):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **values}))


@pytest.mark.parametrize("overrides", [{}, {"rms_norm_eps": 1e-3}])
def test_hub_base_adapter_points_at_the_hub_id_and_saves_no_base(tmp_path, overrides):
    """A hub base is not copied: adapter_config.json names it, as peft's own save would. With
    model.config overrides the base trained is not the hub's: it is saved beside the adapter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.checkpoint.export import save_adapter_folder
    from shardtune.config.schema import ModelConfig, PeftConfig
    from shardtune.model.adapters import add_adapter

    cfg = dict(TINY["llama"])
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg, **overrides)
    model = add_adapter(AutoModelForCausalLM.from_config(hf_config), PeftConfig(method="lora"), seed=0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    save_adapter_folder(model.state_dict(), model, ModelConfig(name_or_path="meta-llama/Llama-2-7b-hf",
                                                               config=overrides),
                        PeftConfig(method="lora"), hf_config, None, tmp_path / "final")
    config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    base = tmp_path / "final" / "base"
    assert config["base_model_name_or_path"] == (str(base.resolve()) if overrides else "meta-llama/Llama-2-7b-hf")
    assert set(config["target_modules"]) == {"q_proj", "v_proj"}
    if overrides:
        assert json.loads((base / "config.json").read_text())["rms_norm_eps"] == overrides["rms_norm_eps"]
    assert base.exists() is bool(overrides)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert saved and all("lora_" in k and k.startswith("base_model.model.") for k in saved)
    assert all(".default." not in k for k in saved)  # peft's on-disk names carry no adapter name


@pytest.mark.parametrize("arch,targets", [("gpt2", {"c_attn"}), ("opt", {"q_proj", "v_proj"}),
                                          ("llama", {"q_proj", "v_proj"})])
def test_default_lora_targets_per_architecture(arch, targets):
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    cfg = dict(TINY[arch])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg))
    wrapped = add_adapter(model, PeftConfig(method="lora", r=4), seed=0)
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters() if "lora_A" in n}
    assert adapted == targets
    assert all(("lora_" in n) == p.requires_grad for n, p in wrapped.named_parameters())


def test_qlora_without_a_gpu_is_refused_in_one_line(assets, tmp_path):
    proc = run_cli(["train", *tiny_overrides(assets, tmp_path / "q", **{"peft.method": "lora",
                                                                        "peft.quantize": "4bit", "device": "cpu"})])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "4bit" in lines[0] and "CUDA" in lines[0], proc.stderr


@pytest.mark.parametrize("extra,needle", [
    ({"peft.method": "lora", "peft.target_modules": "[q_proj]"}, "q_proj"),
    ({"peft.method": "lora", "peft.target_modules": "[attn]"}, "GPT2Attention"),
    # peft's own reason when it is not the module's class (it read "peft.target_modules=[] names modules")
    ({"peft.method": "lora", "peft.target_modules": "[gate]", "model.config": json.dumps(arch_config("mixtral"))},
     "['gate'] (MixtralTopKRouter): lora.ParamWrapper does not work with lora_dropout != 0"),
    ({"peft.method": "lora", "peft.r": 0}, "peft.r"),
    ({"peft.method": "lora", "freeze.trainable_blocks": 1}, "freeze"),
    ({"freeze.trainable_blocks": 5}, "0..2"),
    ({"freeze.trainable_blocks": -1}, "freeze.trainable_blocks=-1 must be at least 0"),
    ({"freeze.head_only": "true", "freeze.trainable_blocks": 1}, "head_only"),
    # the other methods: what the config alone refuses, then what the model type decides
    ({"peft.method": "dora", "peft.lora_plus_ratio": 0.5}, "at least 1"),
    ({"peft.method": "ia3", "peft.target_modules": "[c_attn]", "peft.feedforward_modules": "[c_fc]"}, "c_fc"),
    ({"peft.method": "lora", "peft.init": "pissa", "peft.quantize": "4bit", "device": "cuda"}, "residual"),
    ({"peft.method": "lora", "peft.init": "olora"}, "Conv1D"),
    ({"peft.method": "dora", "peft.init": "pissa", "peft.r": 1000}, "peft.r=1000 directions"),  # SVD's rank failed
    ({"peft.method": "ia3", "peft.target_modules": "[q_proj]"}, "q_proj"),
    ({"peft.method": "adaption_prompt", "model.config": json.dumps(TINY["opt"])}, "gpt2, llama, mistral"),
    ({"peft.method": "adaption_prompt", "peft.adapter_layers": 3}, "1..2"),
])
def test_bad_peft_and_freeze_settings_are_one_line_errors(assets, tmp_path, capsys, extra, needle):
    from shardtune.cli.main import main

    code = main(["train", *tiny_overrides(assets, tmp_path / "bad", **extra)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and needle in err, err


FREEZES = {
    "full": {},
    "top_block": {"freeze.trainable_blocks": 1},
    "head_only": {"freeze.head_only": "true"},
    "embeddings": {"freeze.embeddings": "true"},
}


@pytest.fixture(scope="module")
def freeze_runs(assets, tmp_path_factory):
    """2 optimizer steps of tiny Llama (untied head) for each freeze setting, through Trainer."""
    import contextlib
    import io

    from shardtune.config.load import load_config
    from shardtune.telemetry.metrics import state_bytes
    from shardtune.train.trainer import Trainer

    results = {}
    for name, extra in FREEZES.items():
        out = tmp_path_factory.mktemp(f"freeze-{name}")
        overrides = tiny_overrides(assets, out, "llama", **extra, **{"train.max_steps": 2, "eval.max_batches": 1})
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = Trainer(load_config(None, overrides, defaults={}), overwrite=True)
            params = dict(trainer.model.named_parameters())
            with_grad: list[set] = []
            # just before each update: which parameters got a gradient
            trainer.optimizer.register_step_pre_hook(
                lambda *_, seen=with_grad, params=params: seen.append(
                    {n for n, p in params.items() if p.grad is not None}))
            before = _full_state(trainer.model)
            trainer.fit()
            after = _full_state(trainer.model)
            results[name] = {
                "state_bytes": state_bytes(trainer.model, trainer.optimizer)["optim_bytes"],
                "trainable": {n for n, p in params.items() if p.requires_grad},
                "numel": {n: p.numel() for n, p in params.items()},
                "with_grad": with_grad, "before": before, "after": after,
            }
            trainer.close()
    return results


@pytest.mark.parametrize("name", list(FREEZES))
def test_frozen_parameters_get_no_gradient_no_state_and_do_not_move(freeze_runs, name):
    import torch

    run = freeze_runs[name]
    trainable, frozen = run["trainable"], set(run["numel"]) - run["trainable"]
    assert len(run["with_grad"]) == 2 and all(seen == trainable for seen in run["with_grad"])
    for n in run["numel"]:
        moved = not torch.equal(run["before"][n], run["after"][n])
        assert moved == (n in trainable), (name, n, moved)
    # AdamW keeps exp_avg and exp_avg_sq (fp32) for the trainable parameters only
    assert run["state_bytes"] == 8 * sum(run["numel"][n] for n in trainable)
    if name == "full":
        assert not frozen
    elif name == "top_block":
        assert trainable == {n for n in run["numel"] if n.startswith("model.layers.1.")} | {"model.norm.weight"}
    elif name == "head_only":
        assert trainable == {"lm_head.weight"}
    else:
        assert frozen == {"model.embed_tokens.weight"}


def test_freezing_saves_optimizer_memory(freeze_runs):
    full = freeze_runs["full"]["state_bytes"]
    for name in ("top_block", "head_only", "embeddings"):
        saved = full - freeze_runs[name]["state_bytes"]
        frozen = set(freeze_runs[name]["numel"]) - freeze_runs[name]["trainable"]
        assert saved == 8 * sum(freeze_runs[name]["numel"][n] for n in frozen) > 0, name
    assert freeze_runs["head_only"]["state_bytes"] < freeze_runs["top_block"]["state_bytes"] < full


def test_lora_checkpoint_exports_the_same_adapter_as_final(lora_run, tmp_path):
    """A LoRA run's sharded checkpoint exports to an adapter folder with final/'s logits."""
    import torch
    from peft import AutoPeftModelForCausalLM

    from shardtune.checkpoint.export import export_checkpoint

    out = export_checkpoint(str(lora_run["out"] / "checkpoints" / "step-000003"), tmp_path / "exported")
    assert (out / "adapter_config.json").is_file()
    a = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    b = AutoPeftModelForCausalLM.from_pretrained(str(lora_run["final"])).eval()
    with torch.no_grad():
        assert (a(input_ids=_probe()).logits - b(input_ids=_probe()).logits).abs().max() < 1e-5


def test_eval_and_generate_take_a_lora_run(lora_run, assets, capsys):
    """`shardtune eval` / `generate` on a LoRA run's adapter folder (base folded in)."""
    from shardtune.cli.main import main

    assert main(["eval", str(lora_run["final"]), "--data", assets["validation"], "--seq-len", "64",
                 "--max-batches", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["generate", str(lora_run["out"]), "--prompt", "def", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_default_lora_targets_take_the_variant_the_model_has():
    """DeepSeek-V3's default names both query projections; a model without a low-rank query
    (q_lora_rank=None) has q_proj, not q_b_proj, and gets LoRA there."""
    import torch
    from archs import hf_config
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config("deepseek_v3", q_lora_rank=None))
    wrapped = add_adapter(model, PeftConfig(method="lora", r=4))
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "kv_b_proj"}


def test_default_lora_targets_where_peft_gives_a_pattern():
    """peft's default for Gemma 4 is a pattern over full module names (the language model's q_proj
    and v_proj): its matches are adapted, not its characters."""
    import torch
    from archs import tiny_config
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter, default_lora_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("gemma4"))
    assert default_lora_targets("gemma4") is None  # no model to match the pattern in
    wrapped = add_adapter(model, PeftConfig(method="lora", r=4))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in wrapped.named_parameters() if "lora_A" in n}
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"q_proj", "v_proj"}
    assert len(adapted) == 2 * 2 and all(".language_model." in n for n in adapted)


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama", "gpt_neox", "qwen2", "phi"])
def test_all_linear_adapts_what_peft_adapts(arch):
    """peft.target_modules=[all-linear] (peft's keyword) is made explicit before peft sees it, so
    that plan and train count the same adapters: the layers adapted are peft's own choice for it."""
    import torch
    from archs import hf_config
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    def adapted(model) -> set[str]:
        return {n.split(".lora_A")[0].removeprefix("base_model.model.") for n, _ in model.named_parameters()
                if "lora_A" in n}

    with torch.device("meta"):
        ours = add_adapter(AutoModelForCausalLM.from_config(hf_config(arch)),
                           PeftConfig(method="lora", r=4, target_modules=["all-linear"]), init=False)
        peft_own = get_peft_model(AutoModelForCausalLM.from_config(hf_config(arch)),
                                  LoraConfig(r=4, target_modules="all-linear"))
    assert adapted(ours) == adapted(peft_own) and adapted(ours)


def test_without_the_extras_adapters_are_one_line_and_full_fine_tunes_train(lora_run, assets, tmp_path, monkeypatch,
                                                                       capsys):
    """peft is an extra (the README's install has none): a peft method, an adapter folder or a LoRA
    run's checkpoint named the extra in one line instead of an ImportError's traceback, and a full
    fine-tune imports no extra (`fsdp.wrap=size` imported peft, to tell adapter layers apart)."""
    import sys

    from shardtune.cli.main import main

    extras = ("peft", "torchao", "optuna", "wandb", "mlflow", "tensorboard", "pynvml", "rouge_score", "sacrebleu",
              "mauve", "liger_kernel")  # pyproject's optional dependencies, by import name
    for name in [n for n in sys.modules if n.split(".")[0] in extras] + list(extras):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    for argv in (["train", *tiny_overrides(assets, tmp_path / "lora", **LORA)],
                 ["eval", str(lora_run["final"]), "--max-batches", "1"],
                 ["eval", str(lora_run["out"] / "checkpoints" / "step-000003"), "--max-batches", "1"]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().endswith("not installed: pip install 'shardtune[peft]'"), argv
    full = tiny_overrides(assets, tmp_path / "full", **{"fsdp.wrap": "size", "fsdp.min_num_params": 1000,
                                                        "train.max_steps": 1, "eval.max_batches": 1})
    assert main(["train", *full]) == 0, capsys.readouterr().err
