"""A model whose code comes with it (`model.trust_remote_code`): every folder a run writes or
exports carries that code beside its config.json (model/files.save_model_code), and what reads a
run's folders trusts it as the run did."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides

CONFIG_CODE = ("from transformers import LlamaConfig\n\n\n"
               "class RemoteConfig(LlamaConfig):\n    model_type = 'remotetiny'\n")
MODEL_CODE = ("from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
              "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n")


def remote_code_model(folder):
    """A tiny Llama whose config.json names its own code (auto_map), as a trust_remote_code Hub
    repo holds it."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=300)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remotetiny", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_remote.py").write_text(CONFIG_CODE)
    (folder / "modeling_remote.py").write_text(MODEL_CODE)
    return folder


def test_every_folder_of_a_remote_code_run_loads_with_its_code(assets, tmp_path, single_thread):
    """checkpoints (their DCP folder, or hf_format), a sharded final/ and the exports of either
    held config.json naming modeling_remote.py without the file: `shardtune export` and eval of a
    checkpoint failed ('does not appear to have a file named modeling_remote.py'), the Hub got no
    checkpoint, and from_pretrained could not load a sharded final/; eval and export of final/ said
    'set model.trust_remote_code=true', an option neither has."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.checkpoint.export import export_checkpoint
    from shardtune.checkpoint.loading import load_model
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    base = remote_code_model(tmp_path / "remote_base_st")
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(base)
    out = tmp_path / "run"
    overrides = [o for o in tiny_overrides(assets, out, **{"train.max_steps": 2, "checkpoint.every_steps": 1,
                                                           "checkpoint.keep_last": 0, "eval.max_batches": 1,
                                                           "eval.at_start": "false"})
                 if not o.startswith(("model.config=", "model.tokenizer="))]
    for step, extra in ((1, []), (2, ["checkpoint.hf_format=true", "checkpoint.sharded_final=true", "resume=auto"])):
        run(load_config(None, [*overrides, f"train.max_steps={step}", *extra,
                                f"model.name_or_path={base}", "model.trust_remote_code=true"], defaults={}),
            overwrite=False)
    probe = (torch.arange(32).reshape(2, 16) * 7) % 250
    step1, step2 = (out / "checkpoints" / f"step-00000{i}" for i in (1, 2))
    folders = {"final": out / "final", "step 2 (hf_format)": step2,
               "export of final": export_checkpoint(str(out), tmp_path / "e-final"),
               "export of step 1 (DCP)": export_checkpoint(str(step1), tmp_path / "e-step1")}
    logits = {}
    for name, folder in folders.items():
        assert (folder / "modeling_remote.py").is_file(), name
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__name__ == "RemoteForCausalLM"
        with torch.no_grad():
            logits[name] = model(probe).logits
    assert (logits["final"] - logits["step 2 (hf_format)"]).abs().max() == 0
    assert (logits["final"] - logits["export of final"]).abs().max() == 0
    with torch.no_grad():  # eval and generate read the run's final/ and its checkpoints
        assert (load_model(str(out))[0](probe).logits - logits["final"]).abs().max() == 0
        assert (load_model(str(step1))[0](probe).logits - logits["export of step 1 (DCP)"]).abs().max() == 0


def test_an_adapter_on_a_remote_code_base_is_read_as_its_run_trusted_it(assets, tmp_path, single_thread):
    """A LoRA run on a trust_remote_code base: eval, generate and export --merge of its final/ died
    with transformers' ValueError traceback ('contains custom code'); a copy of that adapter outside
    any run is one line, its code not run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.checkpoint.export import merge_adapter_folder
    from shardtune.checkpoint.loading import load_model
    from shardtune.config.load import load_config
    from shardtune.errors import UserError
    from shardtune.train.trainer import run

    base = remote_code_model(tmp_path / "remote_base_lora_st")
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(base)
    out = tmp_path / "run"
    run(load_config(None, [o for o in tiny_overrides(assets, out, **{"train.max_steps": 1, "eval.max_batches": 1,
                                                                      "eval.at_start": "false"})
                           if not o.startswith(("model.config=", "model.tokenizer="))]
                    + [f"model.name_or_path={base}", "model.trust_remote_code=true", "peft.method=lora"], defaults={}),
        overwrite=False)
    probe = (torch.arange(32).reshape(2, 16) * 7) % 250
    merged = merge_adapter_folder(out, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged, trust_remote_code=True)
    with torch.no_grad():
        assert (load_model(str(out))[0](probe).logits - merged.eval()(probe).logits).abs().max() < 1e-5
    import shutil

    shutil.copytree(out / "final", tmp_path / "loose")
    with pytest.raises(UserError, match="runs code of its own"):
        load_model(str(tmp_path / "loose"))
