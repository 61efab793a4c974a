"""kernels=liger (model/kernels.py): refused in one line where it cannot run (CPU, no Liger-Kernel,
a family Liger has no kernels for, with chunked-loss or QLoRA settings), and, where Liger is
installed, patched into the meta model without changing a parameter name. Its losses against the
plain model are a CUDA test (tests/e2e/test_cuda.py): Liger has no CPU path."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import TINY
from shardtune.config.load import load_config
from shardtune.errors import UserError
from shardtune.model import kernels

BASE = [f"model.config={json.dumps(TINY['llama'])}", "data.path=x", "kernels=liger"]


@pytest.mark.parametrize("overrides, needle", [
    (["device=cpu"], "kernels=liger needs a CUDA GPU: Liger-Kernel's kernels are Triton kernels with no CPU path"),
    (["loss_chunk_tokens=512"], "drop loss_chunk_tokens=512, or set kernels=none"),
    (["peft.method=lora", "peft.quantize=4bit", "model.name_or_path=m", "device=cuda", "precision=bf16"],
     "kernels=liger does not combine with peft.quantize=4bit"),
    (["kernels=fast"], "kernels='fast' is not a valid choice"),
])
def test_what_the_config_alone_refuses(overrides, needle):
    with pytest.raises(UserError, match=re.escape(needle)) as err:
        load_config(None, [*BASE, *overrides])
    assert "\n" not in str(err.value)


def test_the_machine_and_the_family_are_checked(monkeypatch):
    kernels.check("none", torch.device("cpu"), "gpt2")  # nothing asked, nothing checked
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        kernels.check("liger", torch.device("cpu"), "llama")
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=re.escape("pip install 'shardtune[liger]'")):
        kernels.check("liger", torch.device("cuda"), "llama")
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(kernels, "liger_families", lambda: frozenset({"llama"}))
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: "0.8.5")
    kernels.check("liger", "cuda", "llama")
    with pytest.raises(UserError, match=re.escape("Liger-Kernel 0.8.5 has no kernels for model_type 'gpt2'")):
        kernels.check("liger", "cuda", "gpt2")


def test_train_on_cpu_and_plan_refuse_it_in_one_line(capsys):
    from shardtune.cli.main import main

    for argv, needle in ((["train", *BASE[:2], "kernels=liger", "device=auto"], "kernels=liger needs a CUDA GPU"),
                         (["plan", *BASE, "--gpus", "1", "--gpu", "H100"], "kernels=liger is not priced by plan")):
        if argv[0] == "train" and torch.cuda.is_available():
            continue
        code = main(argv)
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("quickstart defaults")]
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_liger_patches_the_meta_model_and_owns_the_head_loss(monkeypatch):
    """Where Liger-Kernel is installed (the liger extra; it imports without a GPU): its modules
    replace the norms and MLPs in place, parameter names stay, and the head computes Liger's loss."""
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    from shardtune.model import loss as loss_lib
    from shardtune.model.hf import build_meta_model, load_hf_config

    for name, value in list(vars(modeling_llama).items()):  # Liger also patches the module: undone after the test
        monkeypatch.setattr(modeling_llama, name, value)

    hf_config = load_hf_config(load_config(None, BASE[:2]).model)
    plain, model = build_meta_model(hf_config), build_meta_model(hf_config)
    assert kernels.apply(model, "liger") and not kernels.apply(plain, "none")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    names = {m._get_name() for m in model.modules()}
    assert {"LigerRMSNorm", "LigerSwiGLUMLP"} <= names, names
    assert loss_lib.install(model, None, "liger")
    assert kernels.describe(model, True).startswith(" | Liger kernels: 7 modules (LigerRMSNorm, LigerSwiGLUMLP)")
    assert kernels.describe(plain, False) == ""


def test_the_head_computes_the_fused_loss_through_its_own_forward(monkeypatch):
    """The wiring of kernels=liger's head loss on CPU, with a stand-in for Liger's
    `liger_fused_linear_cross_entropy` (its contract: reduction="sum", ignore_index, and with
    return_token_accuracy an object with .loss and .token_accuracy, the mean over counted tokens):
    token_loss's sum, count and number correct equal the plain model's, the gradients too, and a
    head trained under a frozen body (its input needs no gradient) still gets its gradient.
    Liger's own kernel against the plain loss is the CUDA test's."""
    import copy
    import sys
    import types

    import torch.nn.functional as F
    from test_loss import batch, tiny_model

    from shardtune.model import loss as loss_lib
    from shardtune.train.step import token_loss

    calls = []

    def fused(x, weight, target, ignore_index=-100, reduction="mean", accum_dtype=None,
              return_token_accuracy=False, **_):
        calls.append((reduction, accum_dtype, x.requires_grad))
        logits = (x @ weight.t()).float()
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        if not return_token_accuracy:
            return loss
        valid = target != ignore_index
        accuracy = ((logits.argmax(-1) == target) & valid).sum() / valid.sum()
        return types.SimpleNamespace(loss=loss, token_accuracy=accuracy)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    plain = tiny_model("llama")
    liger = copy.deepcopy(plain)
    assert loss_lib.install(liger, None, "liger") and loss_lib.is_installed(liger)
    b = batch()
    (sum_p, n_p, _), (sum_l, n_l, _) = token_loss(plain, b), token_loss(liger, b)
    assert int(n_p) == int(n_l) and sum_l.item() == pytest.approx(sum_p.item(), rel=1e-6)
    sum_p.backward()
    sum_l.backward()
    for (name, p), q in zip(plain.named_parameters(), liger.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    assert calls[0] == ("sum", torch.float32, True)
    with torch.no_grad():
        assert int(token_loss(plain, b, accuracy=True)[2]) == int(token_loss(liger, b, accuracy=True)[2])
    for p in liger.parameters():  # only the head trains: its input needs no gradient
        p.grad = None
        p.requires_grad_(p is liger.get_output_embeddings().weight)
    token_loss(liger, b)[0].backward()
    assert liger.get_output_embeddings().weight.grad is not None and calls[-1][2]


def test_a_fresh_model_counted_on_meta_tensors_runs_none_of_the_patched_kernels(monkeypatch):
    """Liger-Kernel swaps its family's classes and functions in the modeling module, process-wide;
    the MFU's attention count then built a fresh model of that family and ran it on meta tensors,
    through Triton kernels (on the H200: an illegal memory access before the first step of every
    kernels=liger run). A stand-in patches as Liger does (a norm class, the rotary function and a
    class's forward, each failing on meta tensors as a kernel given null pointers would): the count
    runs none of them, equals the unpatched count, and the patches stay for the trained model."""
    import sys
    import types

    from transformers.models.llama import modeling_llama

    from shardtune import hf_patches
    from shardtune.model.hf import build_meta_model, load_hf_config
    from shardtune.telemetry import flops

    for owner in (modeling_llama, modeling_llama.LlamaAttention):  # the stand-in's patches: undone after the test
        for name, value in list(vars(owner).items()):
            monkeypatch.setattr(owner, name, value)
    monkeypatch.setattr(hf_patches, "_ORIGINALS", {})
    monkeypatch.setattr(flops, "_COUNTED", {})
    entered = []

    def kernel(name):
        def run(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            entered.append((name, any(t.is_meta for t in tensors)))
            raise RuntimeError(f"{name}: an illegal memory access")
        return run

    class KernelNorm(modeling_llama.LlamaRMSNorm):
        forward = kernel("norm")

    def apply_to_instance(model, **_):
        modeling_llama.LlamaRMSNorm = KernelNorm
        modeling_llama.apply_rotary_pos_emb = kernel("rotary")
        modeling_llama.LlamaAttention.forward = kernel("attention")

    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch._apply_liger_kernel_to_instance = apply_to_instance
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", monkey_patch)

    hf_config = load_hf_config(load_config(None, BASE[:2]).model)
    unpatched = flops.attention_flops(hf_config, 64)
    flops._COUNTED.clear()
    assert kernels.apply(build_meta_model(hf_config), "liger")
    assert flops.attention_flops(hf_config, 64) == unpatched and not entered, entered
    assert modeling_llama.LlamaRMSNorm is KernelNorm  # the trained model's family keeps Liger's modules
    with pytest.raises(RuntimeError, match="illegal memory access"):
        build_meta_model(hf_config)(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
