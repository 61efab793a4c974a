"""Every architecture of the families table (shardtune/families.py), on its tiny config
(tests/archs.py), in one process: the table's facts checked against the model, one real
optimizer step, the router's load-balancing loss equal to the model's own, the chunked loss
equal to the full one (or refused), document masking equal to each document alone (or refused
in one line), and `plan`'s trace of a LoRA run on 2 fake ranks with the default targets."""

from __future__ import annotations

import contextlib

import pytest
from archs import ARCHS, DOCS, hf_config, optimizer_step, packed_batch, packed_vs_alone, run_config

from conftest import readme_renderer
from shardtune.errors import UserError
from shardtune.families import FAMILIES


def test_every_family_has_a_tiny_config_and_is_a_transformers_causal_lm():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert sorted(ARCHS) == sorted(FAMILIES)
    assert not set(FAMILIES) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_facts(model_type, model):
    import torch.nn as nn

    facts = FAMILIES[model_type]
    blocks = [m for m in model.modules() if type(m).__name__ == facts.block]
    assert len(blocks) == 2 and facts.block in model._no_split_modules, model_type
    inside = {name for name, _ in blocks[-1].named_modules() if name}  # the last: an MoE block in DeepSeek-V3
    for kind in (facts.attention, facts.mlp):
        assert kind and set(kind) <= inside, f"{model_type}: {kind} not modules of {facts.block}: {sorted(inside)}"
    assert not set(facts.attention) & set(facts.mlp)
    assert facts.document_mask in (None, "position_ids", "mask_4d")
    head = model.get_output_embeddings()
    assert type(head) is nn.Linear
    return head


def _check_document_mask(model_type, model, batch, rows):
    """A document inside the packed row has the logits it has alone, or the table refuses it
    (and it really does not)."""
    from archs import check_flash_documents, check_long_rows

    from shardtune.config.schema import DataConfig
    from shardtune.data import docmask
    from shardtune.errors import UserError

    worst = packed_vs_alone(model, batch, rows)
    if FAMILIES[model_type].document_mask:
        assert worst <= 1e-5, (model_type, worst)
        docmask.check(DataConfig(path="x", document_mask=True, seq_len=sum(DOCS)), model.config)
        check_flash_documents(model_type, model, rows)
        check_long_rows(model_type, model)
    else:
        assert worst > 1e-3, f"{model_type}: packed documents match ({worst}): the families table can allow it"
        with pytest.raises(UserError, match=f"model type '{model_type}' is not one"):
            docmask.check(DataConfig(path="x", document_mask=True), model.config)


def _check_chunked_loss_and_router_loss(model_type, model, head, batch):
    """The chunked loss equals the full one where the head is plain (and is refused elsewhere, where
    the logits really are not the head's); with the router loss, token_loss equals the model's own."""
    import torch

    from shardtune.data import docmask
    from shardtune.model import loss as loss_lib
    from shardtune.train.step import token_loss

    inputs = docmask.model_inputs(model, batch)
    with torch.no_grad():
        aux = getattr(model(**inputs), "aux_loss", None)
        if aux is not None and not isinstance(aux, torch.Tensor):  # transformers 5.17's granitemoe: no router
            with pytest.raises(UserError, match="returns no router logits"):  # logits, its own loss crashes
                token_loss(model, batch, router=True)
            pytest.skip(f"{model_type}: this transformers computes no router loss (refused in one line)")
        out = model(**inputs, labels=batch["labels"], output_hidden_states=True)
        full, count, _ = token_loss(model, batch, router=True)
        own = out.loss * count  # the model's own loss: mean token loss + coefficient x router loss
        assert abs(float(full) - float(own)) <= 1e-5 * float(own), (model_type, float(full), float(own))
        has_router_loss = getattr(out, "aux_loss", None) is not None
        assert has_router_loss == (model_type in MOE_WITH_ROUTER_LOSS), model_type
        if has_router_loss:  # really in the sum: without it the loss is lower by coefficient x aux x count
            plain = token_loss(model, batch)[0]
            assert abs(float(full - plain) - model.config.router_aux_loss_coef * float(out.aux_loss * count)) < 1e-4
        if FAMILIES[model_type].plain_head:
            assert loss_lib.install(model, 16)
            chunked, _, _ = token_loss(model, batch, router=True)
            assert abs(float(chunked) - float(full)) <= 1e-5 * float(full), (model_type, float(chunked), float(full))
        else:
            assert not loss_lib.install(model, 16)
            assert head.bias is not None or (out.logits - head(out.hidden_states[-1])).abs().max() > 1e-3


# MoE types whose forward adds a router load-balancing loss (DeepSeek-V3 balances by a bias instead)
MOE_WITH_ROUTER_LOSS = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granitemoe", "gpt_oss"}


def _check_plan_with_default_lora(model_type):
    from shardtune.model.adapters import default_lora_targets
    from shardtune.plan.trace import trace_step

    targets = default_lora_targets(model_type)
    assert targets, f"{model_type}: no default LoRA targets"
    cfg = run_config(model_type, "train.global_batch_size=2", "peft.method=lora", "peft.r=4")
    trace = trace_step(cfg, hf_config(model_type), world_size=2)
    assert 0 < trace.params["trainable"] < trace.params["total"] and trace.peak_bytes() > 0
    return targets


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_architecture(model_type):
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in DOCS]
    batch = packed_batch(rows)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(model_type)).eval()
    head = _check_facts(model_type, model)
    _check_document_mask(model_type, model, batch, rows)
    _check_chunked_loss_and_router_loss(model_type, model, head, batch)
    if not FAMILIES[model_type].document_mask:
        batch = {k: v for k, v in batch.items() if k != "position_ids"}
    with _forward_order(model) as order:
        assert optimizer_step(model_type, model, batch) == {n for n, _ in model.named_parameters()}, model_type
    _check_freezing(model_type, model, order)
    targets = _check_plan_with_default_lora(model_type)
    wrapped = add_adapter(model, PeftConfig(method="lora", r=4), seed=0)
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters() if "lora_A" in n}
    # the tiny DeepSeek-V3 has a low-rank query: q_b_proj, no q_proj
    expected = set(targets) - {"q_proj"} if model_type == "deepseek_v3" else set(targets)
    assert adapted == expected, (model_type, adapted, targets)
    _check_default_ia3(model_type)


@contextlib.contextmanager
def _forward_order(model):
    """The model's modules in the order their forwards start, while inside."""
    order: list = []
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(m)) for m in model.modules()]
    try:
        yield order
    finally:
        for hook in hooks:
            hook.remove()


def _check_freezing(model_type, model, order):
    """freeze.trainable_blocks=1 trains the top block and what runs after it but the head (the final
    norm), and nothing that runs before it (BLOOM's embedding norm trained: a family's embedding_norm
    is what this finds); freeze.head_only the whole head (GPT-J's bias was left frozen). What runs
    when: `order` (_forward_order); that the frozen ones get no gradient and do not move:
    tests/model/test_peft.py."""
    from shardtune.config.schema import FreezeConfig
    from shardtune.distributed.fsdp import detect_block_class
    from shardtune.model.adapters import freeze

    block_cls, head = detect_block_class(model), model.get_output_embeddings()
    top = [m for m in model.modules() if isinstance(m, block_cls)][-1]
    end = max(i for i, m in enumerate(order) if any(m is t for t in top.modules()))
    after = {id(p) for m in [*top.modules(), *order[end + 1:]] if m is not head for p in m.parameters(recurse=False)}
    # fsdp.block_class naming a module inside the blocks (finer FSDP units) counts the same blocks
    # (a class only the blocks hold, with weights: an attention, an MLP)
    held = {id(m) for b in model.modules() if isinstance(b, block_cls) for m in b.modules()}
    shared = {type(m) for m in model.modules() if id(m) not in held}
    inner = next(type(m) for m in top.modules() if m is not top and type(m) not in shared
                 and any(True for _ in m.parameters()))
    for settings, trained, unit in ((FreezeConfig(trainable_blocks=1), after, block_cls),
                                    (FreezeConfig(trainable_blocks=1), after, inner),
                                    (FreezeConfig(head_only=True), {id(p) for p in head.parameters()}, block_cls)):
        model.requires_grad_(True)
        freeze(model, settings, unit)
        expected = {n for n, p in model.named_parameters() if id(p) in trained}
        assert {n for n, p in model.named_parameters() if p.requires_grad} == expected, (model_type, settings, unit)
    model.requires_grad_(True)


def _check_default_ia3(model_type):
    """IA3's default targets (the families table's or peft's) are modules of the model, and the
    feed-forward ones among them: it wraps (on the meta device: the structure is what counts)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter, default_ia3_targets

    targets, feedforward = default_ia3_targets(model_type)
    assert set(feedforward) <= set(targets), model_type
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(model_type))
    wrapped = add_adapter(model, PeftConfig(method="ia3"), init=False)
    scaled = {n.rsplit(".ia3_l", 1)[0] for n, p in wrapped.named_parameters() if p.requires_grad}
    assert scaled and all(".ia3_l." in n for n, p in wrapped.named_parameters() if p.requires_grad), model_type
    assert {t for t in targets if any(n.endswith("." + t) for n in scaled)} == set(targets), \
        (model_type, targets, sorted(scaled)[:6])


def test_readme_architecture_table_is_the_families_table():
    render = readme_renderer()
    assert f"{render.TABLE_MARKER}\n{render.architecture_table()}\n" in render.README.read_text(), \
        "README's architecture table is stale: run tools/render_readme_reference.py"
