"""final/ written by every rank (checkpoint.hf_sharded) equals today's gathered save_pretrained folder."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY
from shardtune.distributed.fsdp import build_mesh
from shardtune.model.build import ModelSpec, build_model


def sharded_model(arch: str, d, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY[arch])
    config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg, **extra)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec(config)
    return build_model(spec, build_mesh(spec.fsdp, d), d.device, source=lambda: plain, seed=0).model, config


def assert_same_folder(a, b):
    """Same files, same config, and from_pretrained gives bitwise equal tensors."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    for f in a.glob("*.safetensors"):  # same keys in each file (tied head written once)
        with safe_open(f, "pt") as x, safe_open(b / f.name, "pt") as y:
            assert sorted(x.keys()) == sorted(y.keys())
    if (a / "model.safetensors.index.json").exists():
        ia, ib = (json.loads((p / "model.safetensors.index.json").read_text()) for p in (a, b))
        assert ia["weight_map"] == ib["weight_map"] and ia["metadata"]["total_size"] == ib["metadata"]["total_size"]
    ma, mb = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (a, b))
    assert ma.keys() == mb.keys()
    assert all(torch.equal(ma[k], mb[k]) and ma[k].dtype == mb[k].dtype for k in ma)


@pytest.mark.parametrize("arch,shard_size", [("gpt2", "2GB"), ("llama", "100KB")])
def test_sharded_final_equals_the_gathered_folder(one_rank, tmp_path, monkeypatch, arch, shard_size):
    """GPT-2 (tied head, one file) and Llama (untied, split into several files with an index);
    rows written a few at a time (a chunk of 1000 bytes), each at its place in the file."""
    from shardtune.checkpoint.export import gather_full_state_dict, save_hf_folder
    from shardtune.checkpoint.final import save_final_sharded
    from shardtune.model import hf_sharded_io

    monkeypatch.setattr(hf_sharded_io, "WRITE_CHUNK", 1000)

    model, config = sharded_model(arch, one_rank)
    save_hf_folder(gather_full_state_dict(model), config, None, tmp_path / "gathered", shard_size)
    assert save_final_sharded(model, config, None, tmp_path / "sharded", shard_size, step=5) == "sharded"
    record = tmp_path / "sharded" / "shardtune.json"  # its step, which run_weights compares with the checkpoints'
    assert json.loads(record.read_text()) == {"step": 5}
    record.unlink()
    if arch == "llama":
        assert len(list((tmp_path / "sharded").glob("model-0000*-of-0000*.safetensors"))) > 1
    assert_same_folder(tmp_path / "sharded", tmp_path / "gathered")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder left


def test_a_failure_leaves_no_folder_that_looks_complete(one_rank, tmp_path, monkeypatch):
    from shardtune.checkpoint.final import save_final_sharded
    from shardtune.model import hf_sharded_io

    model, config = sharded_model("gpt2", one_rank)

    def fail(*a, **k):
        raise OSError(28, "No space left on device", "x")

    monkeypatch.setattr(hf_sharded_io, "_write_configs", fail)  # rank 0's last writes fail
    with pytest.raises(OSError):
        save_final_sharded(model, config, None, tmp_path / "final")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_folder(one_rank, tmp_path):
    """final/ written the sharded way onto a disk too small for its weights (a real tmpfs): the
    error names final/'s weights file (the CLI's one line), and nothing is left on that disk."""
    import os

    from conftest import tmpfs
    from shardtune.checkpoint.final import save_final_sharded
    from shardtune.fsio import fs_failure_line

    model, config = sharded_model("gpt2", one_rank)
    with tmpfs(tmp_path / "small", "16k") as small:
        with pytest.raises(OSError) as err:
            save_final_sharded(model, config, None, small / "final")
        line = fs_failure_line(err.value, "-")
        assert line.startswith("disk full while writing " + str(small / "final" / "model.safetensors") + ";")
        assert os.listdir(small) == []


@pytest.mark.parametrize("arch,dtype", [("gpt2", torch.float32), ("llama", torch.bfloat16)])
def test_sharded_load_equals_the_rank0_broadcast(one_rank, tmp_path, monkeypatch, arch, dtype):
    """GPT-2 (tied head, not in the file) and Llama saved in bf16 (cast to fp32 on read, rotary
    buffers rebuilt): every tensor and buffer equals rank 0's load + broadcast; read a few rows
    at a time (a chunk of 100 bytes)."""
    from transformers import AutoModelForCausalLM

    from shardtune.model import hf_sharded_io
    from shardtune.model.hf_sharded_io import local_safetensors_folder

    monkeypatch.setattr(hf_sharded_io, "READ_CHUNK", 100)

    _, config = sharded_model(arch, one_rank)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path / "src")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    spec = ModelSpec(plain.config)
    mesh = build_mesh(spec.fsdp, one_rank)
    folder = local_safetensors_folder(str(tmp_path / "src"))
    sharded = build_model(spec, mesh, one_rank.device, folder=folder)
    broadcast = build_model(spec, mesh, one_rank.device, source=lambda: plain)
    assert (sharded.loaded, broadcast.loaded) == ("sharded", "rank 0")
    a, b = sharded.model.state_dict(), broadcast.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].full_tensor(), b[k].full_tensor()) and a[k].dtype == torch.float32 for k in a)
    bufs = dict(broadcast.model.named_buffers())
    assert all(torch.equal(t, bufs[n]) for n, t in sharded.model.named_buffers())
    if arch == "gpt2":
        assert sharded.model.lm_head.weight is sharded.model.transformer.wte.weight


def test_a_run_loaded_the_sharded_way_trains_like_the_broadcast_one(assets, tmp_path, capsys, monkeypatch):
    """model.sharded_load=true + checkpoint.sharded_final=true: the same per-step losses (fp32,
    exactly) and the same final/ as rank 0's load + gathered save; the start-up line says which.
    `shardtune export` of a checkpoint (streamed, file by file) equals today's whole-model export.
    checkpoint.hf_format=true: the checkpoint's model in safetensors only; from_pretrained loads
    the folder, bitwise the broadcast run's checkpoint; export reads it; a resume from it (model
    from safetensors, optimizer from DCP) continues with the same losses and the same weights.
    Every folder written carries the source model's generation_config.json (derived from
    config.json, its end-of-sequence list was cut to one id and its sampling settings dropped)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from conftest import losses, tiny_overrides
    from shardtune.checkpoint.export import export_checkpoint, save_hf_folder
    from shardtune.checkpoint.folders import find_latest
    from shardtune.checkpoint.loading import load_plain_model
    from shardtune.config.load import load_config
    from shardtune.errors import UserError
    from shardtune.fsio import process_umask
    from shardtune.train.trainer import run

    cfg = dict(TINY["gpt2"])
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg)) \
        .save_pretrained(tmp_path / "src")
    generation = GenerationConfig(eos_token_id=[0, 7], do_sample=True, temperature=0.6, top_p=0.9)
    generation.save_pretrained(tmp_path / "src")
    runs = {}
    for name, flag in (("broadcast", "false"), ("sharded", "true")):
        extra = {"model.name_or_path": str(tmp_path / "src"), "model.sharded_load": flag,
                 "checkpoint.sharded_final": flag, "train.max_steps": 2, "eval.max_batches": 1,
                 "eval.at_start": "false", "activation_checkpointing": "full",  # wrapped blocks: names kept
                 "checkpoint.every_steps": 1 if flag == "true" else 2, "checkpoint.hf_format": flag}
        run(load_config(None, tiny_overrides(assets, tmp_path / name, **extra), defaults={}), overwrite=True)
        runs[name] = losses(tmp_path / name)
    resumed = {**extra, "resume": str(tmp_path / "sharded" / "checkpoints" / "step-000001")}
    run(load_config(None, tiny_overrides(assets, tmp_path / "resumed", **resumed), defaults={}))
    out = capsys.readouterr().out
    assert "weights: sharded" in out and "weights: rank 0" in out and "(sharded)" in out
    assert len(runs["sharded"]) == 2 and runs["sharded"] == runs["broadcast"]
    assert_same_folder(tmp_path / "sharded" / "final", tmp_path / "broadcast" / "final")
    # `shardtune export` of the last checkpoint, one output file at a time: the same folder again
    from shardtune.checkpoint import loading

    with monkeypatch.context() as m:  # the whole model is never loaded
        m.setattr(loading, "load_plain_model", None)
        export_checkpoint(str(tmp_path / "sharded"), tmp_path / "exported", max_shard_size="100KB")
    assert len(list((tmp_path / "exported").glob("model-*-of-*.safetensors"))) > 1
    # today's export, of the broadcast run's checkpoint (all DCP): the same weights
    model, tokenizer, _ = load_plain_model(find_latest(tmp_path / "broadcast" / "checkpoints"))
    assert model.generation_config.to_diff_dict() == generation.to_diff_dict()  # eval and generate of a checkpoint
    save_hf_folder(model.state_dict(), model.config, tokenizer, tmp_path / "gathered", "100KB", model.generation_config)
    assert_same_folder(tmp_path / "exported", tmp_path / "gathered")
    # checkpoint.hf_format: the model only in safetensors (DCP holds the rest), the folder loads
    # in transformers, and the run resumed from step 1 ends on the same weights
    from torch.distributed.checkpoint import FileSystemReader

    step2 = find_latest(tmp_path / "sharded" / "checkpoints")
    in_dcp = FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    assert in_dcp and not [k for k in in_dcp if k.startswith("model.")]
    assert losses(tmp_path / "resumed") == runs["sharded"][1:]
    in_hf, again = (AutoModelForCausalLM.from_pretrained(p).state_dict()
                    for p in (step2, tmp_path / "resumed" / "checkpoints" / step2.name))
    ref = model.state_dict()
    assert in_hf.keys() == ref.keys() and all(torch.equal(in_hf[k], ref[k]) and torch.equal(again[k], ref[k])
                                              for k in ref)
    assert not list((tmp_path / "broadcast" / "checkpoints" / step2.name).glob("*.safetensors"))
    for folder in (tmp_path / "broadcast" / "final", tmp_path / "sharded" / "final", tmp_path / "exported", step2,
                   tmp_path / "resumed" / "final", find_latest(tmp_path / "broadcast" / "checkpoints")):
        assert GenerationConfig.from_pretrained(folder).to_diff_dict() == generation.to_diff_dict(), folder
    # every file is readable as the umask allows (safetensors writes 0600 by itself)
    allowed = 0o666 & ~process_umask()
    assert not [p for name in ("broadcast", "sharded", "resumed", "exported") for p in (tmp_path / name).rglob("*")
                if p.is_file() and (p.stat().st_mode & allowed) != allowed]
    weights = step2 / "model.safetensors"  # truncated on disk: one line naming it
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserError, match=f"weights file '{weights}' is truncated or damaged"):
        load_plain_model(step2)


def test_a_damaged_folder_falls_back_to_the_broadcast_path(one_rank, tmp_path):
    """A truncated shard, one the index names but that is gone, or a stray safetensors file
    beside the indexed ones: no sharded read (the rank-0 load then reports a damaged file in one
    line, as before, and ignores a stray one as from_pretrained does)."""
    from transformers import AutoModelForCausalLM

    _, config = sharded_model("llama", one_rank)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m", max_shard_size="100KB")
    files = sorted((tmp_path / "m").glob("model-*.safetensors"))
    spec = ModelSpec(config)
    mesh = build_mesh(spec.fsdp, one_rank)
    stray = tmp_path / "m" / "model-old.safetensors"  # not in the index: from_pretrained ignores it
    stray.write_bytes(files[0].read_bytes())
    assert build_model(spec, mesh, one_rank.device, folder=tmp_path / "m").loaded == "none"
    stray.unlink()
    assert build_model(spec, mesh, one_rank.device, folder=tmp_path / "m").loaded == "sharded"
    files[-1].unlink()
    assert build_model(spec, mesh, one_rank.device, folder=tmp_path / "m").loaded == "none"
    files[0].write_bytes(files[0].read_bytes()[:100])
    assert build_model(spec, mesh, one_rank.device, folder=tmp_path / "m").loaded == "none"


@pytest.mark.parametrize("damage", ["dtype", "shape"])
def test_a_weight_that_cannot_be_cast_is_one_line_naming_the_file(one_rank, tmp_path, damage):
    """A tensor stored as integers (or in another shape) under the sharded read: one line
    naming the file and the tensor, before anything is allocated."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from shardtune.errors import UserError

    _, config = sharded_model("gpt2", one_rank)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    key = "transformer.h.0.mlp.c_fc.weight"
    tensors[key] = tensors[key].to(torch.int32) if damage == "dtype" else tensors[key][:-1]
    save_file(tensors, path, metadata={"format": "pt"})
    spec = ModelSpec(config)
    with pytest.raises(UserError) as err:
        build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device, folder=tmp_path / "m")
    line = str(err.value)
    assert "\n" not in line and str(path) in line and key in line
    assert ("int32, which cannot be cast to the model's float32" if damage == "dtype" else "with shape") in line


@pytest.mark.parametrize("overrides, needle", [
    (["peft.method=lora", "checkpoint.every_steps=1"], "with peft.method=lora a checkpoint's model is an adapter"),
    ([], "applies to checkpoints, but none are saved; set checkpoint.every_steps=N"),
])
def test_hf_format_checkpoints_are_refused_where_they_cannot_be(overrides, needle):
    import re

    from shardtune.config.load import load_config
    from shardtune.errors import UserError

    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", "checkpoint.hf_format=true", *overrides])


def test_hf_format_refuses_a_model_whose_weights_transformers_renames_on_save(one_rank):
    """Mixtral's experts are stored under other names than its modules': refused when the run
    starts (one line), not at its first checkpoint; a GPT-2 passes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.checkpoint.dcp import ModelOptimizerState
    from shardtune.errors import UserError

    config = AutoConfig.for_model("mixtral", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=100, num_local_experts=2,
                                  num_experts_per_tok=1)
    plain = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec(config)
    model = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device, source=lambda: plain).model
    with pytest.raises(UserError, match="transformers renames its weights on save; set checkpoint.hf_format=false"):
        ModelOptimizerState(model, None, config)
    gpt2, gpt2_config = sharded_model("gpt2", one_rank)
    ModelOptimizerState(gpt2, None, gpt2_config)


@pytest.mark.parametrize("other", [("os", 28, "No space left on device", "/x/final/model.safetensors"),
                                   ("user", "weights file '/m/a.safetensors' holds w as int32"),
                                   ("other", "ValueError: odd")])
def test_a_failure_on_another_rank_is_raised_here_as_the_same_one_line(one_rank, monkeypatch, other):
    """Rank 0 prints the error line: when rank 1's write failed, rank 0 raises the same disk error
    (naming the file) or UserError, else a line naming rank 1 and its error."""
    import torch.distributed as dist

    from shardtune.checkpoint.hf_sharded import together
    from shardtune.errors import UserError
    from shardtune.fsio import fs_failure_line

    def gather(seen, mine):
        seen[:] = [mine, other]

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises((OSError, UserError, RuntimeError)) as err:
        together(lambda: None)
    if other[0] == "os":
        assert fs_failure_line(err.value, "-").startswith("disk full while writing /x/final/model.safetensors;")
    elif other[0] == "user":
        assert isinstance(err.value, UserError) and str(err.value) == other[1]
    else:
        assert str(err.value) == "rank 1 failed writing its part of the model folder (ValueError: odd)"


@pytest.mark.parametrize("arch,tied", [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)])
def test_an_hf_format_checkpoint_loads_in_one_process_as_saved(one_rank, tmp_path, assets, arch, tied):
    """A checkpoint.hf_format checkpoint (its model in safetensors, a tied head written once), as the
    Checkpointer writes it, read by load_plain_model (eval, generate): every tensor the sharded
    model's. The skeleton it read into was untied (no_init_weights), so a tied head, absent from
    the files as save_pretrained leaves it, was taken for a damaged checkpoint: GPT-2's eval and
    generate of any such checkpoint were refused."""
    from transformers import AutoTokenizer

    from shardtune.checkpoint.dcp import Checkpointer, ModelOptimizerState
    from shardtune.checkpoint.loading import load_plain_model
    from shardtune.config.schema import CheckpointConfig, RunConfig

    model, config = sharded_model(arch, one_rank, tie_word_embeddings=tied)
    optimizer = torch.optim.AdamW(model.parameters())

    def extras(folder):
        config.save_pretrained(folder)
        AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(folder / "tokenizer")

    ckpt = Checkpointer(tmp_path, CheckpointConfig(hf_format=True), ModelOptimizerState(model, optimizer, config), {},
                        describe=lambda step: {"config": RunConfig().to_dict()}, write_extras=extras)
    folder = ckpt.save(1)
    loaded, _, _ = load_plain_model(folder)
    want = {k: v.full_tensor() for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) is tied
