"""The peft methods beyond plain LoRA, each trained for 3 steps on tiny Llama through Trainer:
DoRA (rsLoRA scaling), PiSSA with LoRA+, OLoRA, IA3, adaption prompt (LLaMA-Adapter), prefix
and prompt tuning (their own checks: tests/model/test_prompt_learning.py).
Per method: the trainable share is printed and only the adapters move; final/ and a
checkpoint's export load with `PeftModel.from_pretrained` as they are and give the trained
model's logits; `export --merge` gives the same logits or is refused in one line. PiSSA/OLoRA
start at the base model's logits; LoRA+ moves B at the ratio times A's step; resume = straight
run. The 2-rank equality of each method is in tests/e2e/test_distributed.py."""

from __future__ import annotations

import json

import pytest

from conftest import LORA_PLUS, PEFT_LR, PEFT_METHODS, TINY, logits_of, losses, peft_overrides

ADAPTER_TAGS = {"dora": ("lora_",), "pissa": ("lora_",), "olora": ("lora_",), "ia3": ("ia3_",),
                "adaption_prompt": ("adaption_",), "prefix_tuning": ("prompt_encoder.",),
                "prompt_tuning": ("prompt_encoder.",)}
MERGEABLE = {"dora", "pissa", "olora", "ia3"}


@pytest.mark.parametrize("name", list(PEFT_METHODS))
def test_method_trains_only_its_adapters_and_prints_the_trainable_share(peft_runs, name):
    import re

    import torch

    run = peft_runs[name]
    line = next(line for line in run["stdout"].splitlines() if "trainable" in line)
    share = float(re.search(r"trainable, ([0-9.e-]+)%", line).group(1))
    print(f"{name}: {line.strip()}")
    assert "PeftModel" in line and 0 < share < 10, line
    assert run["trainable"] and all(any(t in n for t in ADAPTER_TAGS[name]) for n in run["trainable"]), name
    assert len(losses(run["out"])) == 3
    for key, before in run["before"].items():
        changed = not torch.equal(before, run["after"][key])
        trained = any(t in key for t in ADAPTER_TAGS[name]) and "base_layer" not in key
        # adaption prompt: the gate starts at 0, so the prompt gets no gradient in step 1 but moves after
        assert changed == trained, (name, key, changed)


@pytest.mark.parametrize("name", list(PEFT_METHODS))
def test_final_and_checkpoint_export_load_with_peft_and_give_the_trained_logits(peft_runs, name, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint.export import export_checkpoint

    run = peft_runs[name]
    # --max-shard-size reaches the base saved beside the adapter (it was written whole, the option ignored)
    exported = export_checkpoint(str(run["out"] / "checkpoints" / "step-000003"), tmp_path / "exported", 100_000)
    assert len(list((exported / "base").glob("*.safetensors"))) > 1, name
    for folder in (run["final"], exported):
        config = json.loads((folder / "adapter_config.json").read_text())
        base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
        loaded = PeftModel.from_pretrained(base, folder)
        assert (logits_of(loaded) - run["logits"]).abs().max() < 1e-5, (name, folder)


@pytest.mark.parametrize("name", list(PEFT_METHODS))
def test_merge_gives_the_adapter_logits_or_is_refused_in_one_line(peft_runs, name, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from shardtune.cli.main import main

    merged = tmp_path / "merged"
    code = main(["export", str(peft_runs[name]["final"]), str(merged), "--merge"])
    err = capsys.readouterr().err
    if name not in MERGEABLE:
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert "cannot be merged" in err and not merged.exists()
        return
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any(t in n for n, _ in model.named_parameters() for t in ("lora_", "ia3_"))
    assert (logits_of(model) - peft_runs[name]["logits"]).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["pissa", "olora"])
def test_residual_init_starts_at_the_base_model(peft_runs, name):
    """PiSSA/OLoRA put the base's principal part into the adapter and keep the residual in the
    base weights: the sum, and so the initial logits, are the base model's."""
    run = peft_runs[name]
    assert (run["initial"] - run["base"]).abs().max() < 1e-4
    assert run["initial"].abs().max() > 1e-3  # not a vacuous comparison
    assert any(k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in run["before"].items())


def test_lora_plus_gives_the_b_matrices_the_ratio_times_the_learning_rate(peft_runs):
    """Optimizer groups: every lora_B at LORA_PLUS x lr, the rest at lr; and one Adam step (its
    first update is about lr per element, whatever the gradient's size) moves B by the ratio
    times A's step (PiSSA: both start non-zero, so both get gradients)."""
    run = peft_runs["pissa"]
    lr_of = {pid: lr for lr, ids in run["groups"] for pid in ids}
    for n in run["trainable"]:
        assert lr_of[run["ids"][n]] == pytest.approx(PEFT_LR * (LORA_PLUS if "lora_B" in n else 1.0)), n
    step = {k: (run["stepped"][0][k] - run["before"][k]).abs().max().item() for k in run["before"]}
    a = max(v for k, v in step.items() if "lora_A" in k)
    b = max(v for k, v in step.items() if "lora_B" in k)
    assert a == pytest.approx(PEFT_LR, rel=0.05) and b == pytest.approx(LORA_PLUS * PEFT_LR, rel=0.05), (a, b)


@pytest.mark.parametrize("name", sorted(set(PEFT_METHODS) - {"prefix_tuning", "prompt_tuning"}))  # theirs: there
def test_resume_equals_the_straight_run(peft_runs, assets, tmp_path, name):
    """Each method resumed at step 2 (PiSSA + LoRA+: residual base weights and the lr groups in the
    checkpoint) takes the straight run's step 3."""
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    straight = peft_runs[name]["out"]
    resumed = tmp_path / "resumed"
    step2 = str(straight / "checkpoints" / "step-000002")
    run(load_config(None, peft_overrides(assets, resumed, name, resume=step2), defaults={}))
    got, want = losses(resumed), losses(straight)
    assert len(got) == 1 and abs(got[0] - want[2]) < 1e-6, (got, want)


@pytest.mark.parametrize("method", ["lora", "dora", "ia3"])
def test_a_method_adapting_the_lm_head_falls_back_to_full_logits(method):
    """The chunked loss computes the head's matmul itself: a head wrapped by an adapter keeps
    the model's own forward (full logits), one that is not wrapped gets the chunked loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model import loss as loss_lib
    from shardtune.model.adapters import add_adapter

    cfg = dict(TINY["llama"])
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg)
    for targets, chunked in ((["q_proj", "lm_head"], False), (None, True)):
        model = add_adapter(AutoModelForCausalLM.from_config(hf_config),
                            PeftConfig(method=method, target_modules=targets), seed=0)
        assert loss_lib.install(model, None) == chunked, (method, targets)


@pytest.mark.parametrize("name", ["adaption_prompt", "ia3"])
def test_eval_and_generate_take_the_adapter_folder_and_the_checkpoint(peft_runs, name, assets, capsys):
    """`shardtune eval` of final/ (an adapter that does not fold: built with its structure on
    every rank; IA3: folded) and of the step-3 checkpoint it came from: the same loss; and
    `generate` takes the run."""
    from shardtune.cli.main import main

    got = []
    for model in (peft_runs[name]["final"], peft_runs[name]["out"] / "checkpoints" / "step-000003"):
        assert main(["eval", str(model), "--data", assets["validation"], "--seq-len", "64",
                     "--max-batches", "2"]) == 0
        got.append(float(next(line.split()[1] for line in capsys.readouterr().out.splitlines()
                              if line.startswith("loss"))))
    assert abs(got[0] - got[1]) < 1e-4, got
    assert main(["generate", str(peft_runs[name]["out"]), "--prompt", "def", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_the_model_card_names_the_method_and_the_peft_library():
    from shardtune.config.schema import RunConfig
    from shardtune.publish.card import model_card

    for method, says in (("ia3", "An IA3 adapter trained"), ("dora", "A DoRA adapter trained"),
                         ("adaption_prompt", "A LLaMA-Adapter adapter trained"), ("none", "A model trained")):
        cfg = RunConfig()
        cfg.peft.method = method
        card = model_card(cfg.to_dict(), 3, None)
        assert says in card and ("library_name: peft" in card) == (method != "none"), card[:400]
        assert (" r=8 alpha=16" in card) == (method == "dora")


def test_lora_initialisations_and_rslora_scaling():
    """default (Kaiming-uniform A) and gaussian (normal A, std 1/r) both start B at zero: the base's
    logits; rsLoRA scales by alpha / sqrt(r), plain LoRA by alpha / r."""
    import math

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    cfg = dict(TINY["llama"])
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg)
    def base():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(hf_config)

    want, a_values = logits_of(base()), {}
    for init, rslora in (("default", False), ("gaussian", True)):
        model = add_adapter(base(), PeftConfig(method="lora", r=4, alpha=16, init=init, rslora=rslora), seed=0)
        assert (logits_of(model) - want).abs().max() < 1e-6, init
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.scaling["default"] == pytest.approx(16 / math.sqrt(4) if rslora else 16 / 4)
        assert not layer.lora_B["default"].weight.any()
        a_values[init] = layer.lora_A["default"].weight.detach()
    bound = 1 / math.sqrt(64)  # Kaiming-uniform(a=sqrt(5)) bound for fan_in 64
    assert a_values["default"].abs().max() <= bound < a_values["gaussian"].abs().max()


@pytest.mark.parametrize("method", ["lora", "dora", "ia3"])
def test_gpt2_conv1d_targets_are_declared_to_peft_without_a_warning(method):
    """GPT-2's Conv1D stores its weight transposed: the adapter config says so (fan_in_fan_out),
    so peft neither corrects it with a warning in every run's output nor adapts the wrong axis."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY["gpt2"].items() if k != "model_type"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = add_adapter(model, PeftConfig(method=method), seed=0)
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)]
    assert wrapped.peft_config["default"].fan_in_fan_out


def test_the_default_rule_leaves_out_a_linear_with_a_forward_of_its_own():
    """DeepSeek-V4's o_a_proj is an nn.Linear whose forward is block-diagonal (grouped), not
    x @ W.T: LoRA's added product would not match its output, so the rule does not pick it."""
    import torch
    from archs import tiny_config
    from transformers import AutoModelForCausalLM

    from shardtune.model.adapters import default_lora_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v4"))
    assert any(type(m).__name__ == "DeepseekV4GroupedLinear" for m in model.modules())
    targets = default_lora_targets("deepseek_v4", model)
    assert targets and "o_a_proj" not in targets, targets


def test_adapters_inside_an_autograd_function_of_their_own_get_gradient():
    """Reformer's reversible layers run inside an autograd Function, which passes gradient only
    if an input requires it: the frozen embedding's output is made to (add_adapter)."""
    import torch
    from archs import DOCS, tiny_config
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    torch.manual_seed(0)
    model = add_adapter(AutoModelForCausalLM.from_config(tiny_config("reformer")), PeftConfig(method="lora", r=4))
    model.train()
    model(input_ids=torch.randint(2, 250, (1, sum(DOCS)))).logits.float().square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # (A: zero while B is)
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
