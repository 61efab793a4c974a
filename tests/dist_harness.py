"""Run under torchrun by test_distributed.py: several jobs in one launch, to keep the number of
(slow) multi-process starts small. argv[1] is a JSON spec; results go to spec["result"]."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.config.load import load_config
from shardtune.distributed.process_group import init_distributed
from shardtune.train.trainer import Trainer


def check_loading(folder: str) -> float:
    """Max |difference| between a 2-rank sharded load of `folder` and a plain from_pretrained
    (rank 0's broadcast; the per-rank sharded read must give the very same tensors)."""
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint.export import gather_full_state_dict
    from shardtune.checkpoint.final import save_final_sharded
    from shardtune.config.schema import FSDPConfig, ModelConfig
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.model.hf import load_hf_config, load_source_model
    from shardtune.model.hf_sharded_io import local_safetensors_folder

    model_cfg = ModelConfig(name_or_path=folder)
    d = init_distributed("cpu")
    hf_config = load_hf_config(model_cfg)
    model = build_model(ModelSpec(hf_config), build_mesh(FSDPConfig(), d), d.device,
                        source=lambda: load_source_model(model_cfg, hf_config, seed=0)).model
    full = gather_full_state_dict(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    # model.sharded_load: each rank reads only its slices; the same weights as rank 0's broadcast
    own = build_model(ModelSpec(hf_config), build_mesh(FSDPConfig(), d), d.device,
                      folder=local_safetensors_folder(folder))
    assert own.loaded == "sharded"
    own_full = gather_full_state_dict(own.model)
    assert all(torch.equal(own_full[k], full[k]) for k in full), "sharded load differs"
    assert all(torch.equal(b, buffers[n]) for n, b in own.model.named_buffers())
    resaved = Path(folder + "-resaved")  # final/ written by both ranks, split over several files
    assert save_final_sharded(model, hf_config, None, resaved, "50KB") == "sharded"
    if not d.is_main:
        return 0.0
    assert len(list(resaved.glob("model-*-of-*.safetensors"))) > 1
    assert (resaved / "model.safetensors.index.json").is_file()
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = plain.state_dict()
    again = AutoModelForCausalLM.from_pretrained(resaved, dtype=torch.float32).state_dict()
    assert again.keys() == ref.keys() and all(torch.equal(again[k], ref[k]) for k in ref), "sharded save differs"
    diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
    diff = max([diff] + [(buffers[n] - b).abs().max().item() for n, b in plain.named_buffers()])
    assert set(full) >= set(ref), set(ref) - set(full)
    return diff


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    if spec.get("eager_torchao"):  # torchao's low-bit steps uncompiled: a C++ build per shape costs minutes on CPU
        torch.compile = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    if spec.get("float8_on_cpu"):
        from conftest import lift_float8_device_check

        lift_float8_device_check()
    if spec.get("rank_memory"):  # each rank its own peak, rank r's r x 100 GiB up: the records must hold the largest
        from shardtune.telemetry import metrics

        measured = metrics.memory_stats
        metrics.memory_stats = lambda device: {k: v + 100 * dist.get_rank() for k, v in measured(device).items()}
    result = {"loading": {}, "export_logit_diff": None, "measured": {}}
    for folder in spec.get("load", []):
        result["loading"][folder] = check_loading(folder)
    for name, overrides in spec.get("measure", {}).items():  # plan.measure: what the step really holds
        from shardtune.model.hf import load_hf_config
        from shardtune.plan.measure import measure_step

        cfg = load_config(None, overrides, defaults={})
        # a loaded machine only adds to the measure (gloo's frees counted late): the lower of two
        result["measured"][name] = min(measure_step(cfg, load_hf_config(cfg.model), init_distributed("cpu"))
                                       for _ in range(2))
    for i, overrides in enumerate(spec.get("jobs", [])):
        resuming = any(o.startswith("resume=") for o in overrides)  # into a new folder: nothing to overwrite
        trainer = Trainer(load_config(None, overrides, defaults={}), overwrite=not resuming)
        trainer.fit()
        if i == 0 and spec.get("export"):
            probe = torch.arange(32).reshape(2, 16) % 200
            with torch.no_grad():
                trainer.model.eval()
                logits = trainer.model(input_ids=probe).logits
            folder = trainer.export()
            if trainer.dist.is_main:
                from transformers import AutoModelForCausalLM

                loaded = AutoModelForCausalLM.from_pretrained(folder)
                with torch.no_grad():
                    result["export_logit_diff"] = (loaded(input_ids=probe).logits - logits).abs().max().item()
        trainer.close()
    if dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()  # as shardtune's own __main__: no teardown collections over torch's objects (seconds)
