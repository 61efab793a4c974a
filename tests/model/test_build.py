"""The one build (build.build_model) and the one sharding policy (parallel.reshard_after_forward)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from archs import hf_config as arch_hf_config
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY
from shardtune.config.schema import FSDPConfig, PeftConfig
from shardtune.distributed.fsdp import build_mesh, reshard_after_forward
from shardtune.families import FAMILIES
from shardtune.model.build import ModelSpec, build_model


@pytest.mark.parametrize("sharding,group,device,expected", [
    ("full_shard", 4, "cpu", True), ("hybrid_shard", 2, "cuda", True),
    ("full_shard", 1, "cuda", True), ("hybrid_shard", 1, "cuda", True),  # one rank's gathered copy: GPU memory
    ("full_shard", 1, "cpu", False), ("hybrid_shard", 1, "cpu", False),  # a CPU keeps it (a copy costs time)
    ("shard_grad_op", 4, "cuda", False), ("shard_grad_op", 1, "cuda", False), ("no_shard", 1, "cuda", False)])
def test_one_policy_decides_resharding_and_gradient_sync(sharding, group, device, expected):
    assert reshard_after_forward(sharding, group, device) is expected


def hf_config(arch: str):
    from transformers import AutoConfig

    cfg = dict(TINY[arch])
    return AutoConfig.for_model(cfg.pop("model_type"), vocab_size=300, **cfg)


@pytest.mark.parametrize("arch,block", [("gpt2", "GPT2Block"), ("opt", "OPTDecoderLayer"),
                                        ("llama", "LlamaDecoderLayer")])
def test_without_a_source_the_sharded_skeleton_stays_on_meta(one_rank, arch, block):
    spec = ModelSpec(hf_config(arch))
    built = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device)
    assert built.block_cls.__name__ == block and len(built.units) == 2
    assert all(p.is_meta for p in built.model.parameters())
    assert not built.sync_grads_each_micro_step  # one rank: gradients reduced once per step
    assert built.model.config._attn_implementation == "sdpa"  # fused attention kernels on CUDA


def test_the_build_leaves_the_run_config_as_it_was(one_rank):
    """What the build sets on the model's config (activation checkpointing turns the cache off)
    stays off the run's config, which final/ and every checkpoint save: their config.json said
    use_cache=false, and generation afterwards ran without its cache."""
    spec = ModelSpec(hf_config("llama"), activation_checkpointing="full")
    saved = spec.hf_config.to_dict()
    built = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device)
    assert built.model.config.use_cache is False and spec.hf_config.to_dict() == saved


def test_a_source_fills_the_weights_and_adapters_match(one_rank):
    from transformers import AutoModelForCausalLM

    spec = ModelSpec(hf_config("gpt2"), peft=PeftConfig(method="lora"), fsdp=FSDPConfig(sharding="no_shard"))
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(spec.hf_config)
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    built = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device, source=lambda: plain, seed=3)
    state = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v.full_tensor()
             for k, v in built.model.state_dict().items() if "lora_" not in k}
    assert set(reference) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_a_checkpoint_saves_and_loads_explicit_state_without_a_trainer(one_rank, tmp_path):
    """The checkpointer takes state objects (torchtitan's `states={...}`): no Trainer needed."""
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint.dcp import Checkpointer, ModelOptimizerState
    from shardtune.checkpoint.folders import read_meta
    from shardtune.config.schema import CheckpointConfig, TrainConfig
    from shardtune.train.optim import build_optimizer
    from shardtune.train.state import TrainState

    spec = ModelSpec(hf_config("llama"))
    model = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device,
                        source=lambda: AutoModelForCausalLM.from_config(spec.hf_config)).model
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2), one_rank.device)

    def step():
        model(input_ids=torch.arange(16).reshape(2, 8)).logits.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    progress = TrainState(step=1, tokens_seen=16.0)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(), ModelOptimizerState(model, optimizer),
                        {"train_state": progress}, describe=lambda s: {"config": {"note": s}})
    folder = ckpt.save(1)
    saved = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    step()  # moves the weights and the optimizer state on
    progress.step, progress.tokens_seen = 2, 32.0
    assert read_meta(folder)["train_state"] == {"step": 1, "tokens_seen": 16.0}
    assert read_meta(folder)["config"] == {"note": 1}
    ckpt.load(folder)
    assert (progress.step, progress.tokens_seen) == (1, 16.0)
    assert all(torch.equal(p.full_tensor(), saved[n]) for n, p in model.named_parameters())
    ckpt.close()


def test_a_format_1_checkpoint_reads_its_progress(tmp_path):
    import json

    from shardtune.checkpoint.folders import read_meta

    (tmp_path / ".metadata").write_text("")
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "step": 7, "tokens_seen": 99.0, "config": {},
                                                    "scheduler": {"last_epoch": 7}, "world_size": 1}))
    assert read_meta(tmp_path)["train_state"] == {"step": 7, "tokens_seen": 99.0}


def test_an_embedding_weight_read_beside_the_lookup_stays_gathered():
    """Gemma 4's multimodal forward reads its embedding's pad row after the lookup: that unit is not
    resharded after forward (on 2 ranks the row would be a sharded DTensor, the `plan` trace's and
    the run's crash); Llama 4 only asks where the weight lives, Gemma 4's text model not at all."""
    from archs import tiny_config
    from transformers import AutoModelForCausalLM

    from shardtune.distributed.fsdp import reads_embedding_weight

    for model_type, reads in (("gemma4", True), ("gemma4_text", False), ("llama4_text", False)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        assert reads_embedding_weight(model, model.get_input_embeddings()) is reads, model_type


class DeviceAllocations(TorchDispatchMode):
    """The shapes of the tensors placed or moved onto `device`: every op told to make its output
    there (empty_like for to_empty, _to_copy for .to, factories)."""

    def __init__(self, device):
        super().__init__()
        self.device, self.shapes, self.on = device, [], [False]

    @contextlib.contextmanager
    def recording(self, on: bool):
        self.on.append(on)
        try:
            with self:
                yield
        finally:
            self.on.pop()

    def wrap(self, fn, on: bool):
        def wrapped(*args, **kwargs):
            with self.recording(on):
                return fn(*args, **kwargs)
        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on[-1] and isinstance(out, torch.Tensor) and \
                torch.device(kwargs.get("device", "cpu")).type == self.device.type:
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("from_folder", [False, True], ids=["rank-0 broadcast", "sharded HF folder"])
@pytest.mark.parametrize("offload", [True, False], ids=["cpu_offload", "on the device"])
def test_offloaded_parameters_never_reach_the_device(one_rank, monkeypatch, tmp_path, offload, from_folder):
    """fsdp.cpu_offload: FSDP2 refuses to start with any parameter (the root's own final norm
    included) on the device. The device here is a stand-in (meta) so that CPU tests can tell the
    two places apart: every tensor made on it while the weights are filled is recorded."""
    from transformers import AutoModelForCausalLM

    import shardtune.model.hf as hf
    import shardtune.model.hf_sharded_io as sharded_io

    spec = ModelSpec(hf_config("llama"), fsdp=FSDPConfig(cpu_offload=offload))
    source = AutoModelForCausalLM.from_config(spec.hf_config)
    if from_folder:
        source.save_pretrained(tmp_path)
    device = torch.device("meta")
    recorder = DeviceAllocations(device)
    for module, name, record in ((hf, "materialize", True), (sharded_io, "load_hf_sharded", True),
                                 # these two make meta shells by design (a file plan, a buffer shell)
                                 (sharded_io, "hf_file_plan", False), (sharded_io, "_buffers_of", False)):
        monkeypatch.setattr(module, name, recorder.wrap(getattr(module, name), record))

    built = build_model(spec, build_mesh(spec.fsdp, one_rank), device, source=lambda: source,
                        folder=tmp_path if from_folder else None)
    assert built.loaded == ("sharded" if from_folder else "rank 0")
    params = {n: p.to_local() for n, p in built.model.named_parameters()}
    buffers = dict(built.model.named_buffers())
    assert buffers and all(b.device == device for b in buffers.values())  # the forward's tables
    param_shapes = {tuple(p.shape) for p in params.values()} - {tuple(b.shape) for b in buffers.values()}
    placed = set(recorder.shapes) & param_shapes
    if offload:
        assert all(p.device.type == "cpu" for p in params.values()), "a parameter is on the device"
        assert "model.norm.weight" in params and not placed, f"parameter-shaped tensors went to the device: {placed}"
    else:  # the recorder sees parameters placed on the device when they belong there
        assert placed == param_shapes


@pytest.mark.parametrize("model_type", sorted(t for t, f in FAMILIES.items() if f.view_output_checked))
def test_units_returning_views_still_get_the_unsharded_gradients(one_rank, model_type, monkeypatch):
    """OPT's decoder layer returns a view (`(residual + h).view(shape)`), and so does a head with a
    bias (GPT-J's, CodeGen's, Phi's logits), and the root that returns them; FSDP2 warns that a unit
    can lose its pre-backward hook if the caller writes into its output in place. These families
    never do: with every unit resharded after forward (the hook must gather it again), the gradients
    equal an unwrapped model's, for one micro-batch and accumulated over two (the first without
    gradient sync), so shardtune silences that warning for the families checked here (and only there)."""
    import copy
    import warnings

    from transformers import AutoModelForCausalLM

    from shardtune.distributed import fsdp

    monkeypatch.setattr(fsdp, "reshard_after_forward", lambda *_: True)
    spec = ModelSpec(arch_hf_config(model_type, **{k: 0.0 for k in DROPOUT.get(model_type, ())}))
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(spec.hf_config)
    reference = copy.deepcopy(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        model = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device, source=lambda: plain).model
        batches = [torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        for micro in (batches[:1], batches):
            for i, ids in enumerate(micro):
                model.set_requires_gradient_sync(i == len(micro) - 1)
                model(input_ids=ids, labels=ids).loss.backward()
                reference(input_ids=ids, labels=ids).loss.backward()
            expected = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                assert torch.allclose(p.grad.full_tensor(), expected[name].grad, atol=1e-6), name
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]


# each family's dropout fields, off so that the two models draw no different masks
DROPOUT = {"opt": ("dropout", "attention_dropout"), "gptj": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
           "codegen": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
           "phi": ("resid_pdrop", "embd_pdrop", "attention_dropout")}


def test_a_random_init_config_raises_no_warning_about_ids_the_tokenizer_replaces():
    """The quickstart's GPT-2 (vocab 2048) keeps GPT-2's eos id 50256 until match_tokenizer sets the
    tokenizer's: transformers warned about that id at construction, above the run's first line."""
    import logging

    from transformers.utils import logging as hf_logging

    from shardtune.config.schema import ModelConfig
    from shardtune.model.hf import load_hf_config

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers.configuration_utils")
    logger.addHandler(handler)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # an in-process run earlier in this worker may have set it to errors
    try:
        # a vocabulary no other test uses: transformers warns once per message
        hf = load_hf_config(ModelConfig(config={"model_type": "gpt2", "vocab_size": 1999, "n_layer": 1}))
        assert hf.eos_token_id == 50256  # unchanged until match_tokenizer
        load_hf_config(ModelConfig(config={"model_type": "gpt2", "vocab_size": 1998, "pad_token_id": 5000}))
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert not [m for m in seen if "bos_token_id" in m or "eos_token_id" in m], seen
    assert any("pad_token_id" in m and "got 5000" in m for m in seen), seen  # the user's own id still warns


def test_a_head_sharing_a_parameter_beyond_the_embedding_stays_in_the_root(one_rank):
    """BERT's LM head ties its weight to the input embedding and its bias to its parent's `bias`:
    a unit of [embedding, head] would split that bias between two units (FSDP2 refused it at the
    first forward). Kept in the root, it trains with an unwrapped model's gradients."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("bert", vocab_size=300, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, num_hidden_layers=1, is_decoder=True,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    spec = ModelSpec(config)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(plain)
    model = build_model(spec, build_mesh(spec.fsdp, one_rank), one_rank.device, source=lambda: plain).model
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad.full_tensor(), expected[name].grad, atol=1e-6), name


def test_a_pre_quantized_folder_s_packed_weights_fit_and_a_wrong_shape_does_not(tmp_path):
    """model/weights_fit: a weight packed into fewer integers (bitsandbytes' 4-bit as [n, 1] uint8)
    is not another shape; the same tensor in a float dtype is refused."""
    from safetensors.torch import save_file

    from shardtune.errors import UserError
    from shardtune.model.hf import build_meta_model
    from shardtune.model.weights_fit import check_weights_fit

    model = build_meta_model(hf_config("gpt2"), False)
    tensors = {name: torch.zeros(p.shape) for name, p in model.state_dict().items() if name != "lm_head.weight"}
    name = next(n for n in tensors if n.endswith("attn.c_attn.weight"))
    tensors[name] = torch.zeros(tensors[name].numel() // 2, 1, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors")
    check_weights_fit(tmp_path, [tmp_path / "model.safetensors"], model)
    tensors[name] = tensors[name].float()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match=f"weight {name} in model.safetensors has shape"):
        check_weights_fit(tmp_path, [tmp_path / "model.safetensors"], model)
