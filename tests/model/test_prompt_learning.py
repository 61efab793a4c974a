"""Prefix tuning and prompt tuning (peft), beyond the checks every method gets in
tests/model/test_peft_methods.py (only the adapters train, the share is printed, final/ and a
checkpoint's export load with peft at the trained logits, merge refused) and the 2-rank launch:
the loss falls, resume is the straight run, eval and generate use the virtual tokens, the
chunked loss is the full-logits loss (and peft's own), prompt_init_text, bf16, and what cannot
work is refused in one line."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY, losses, peft_overrides, tiny_overrides

METHODS = ("prompt_tuning", "prefix_tuning")


@pytest.mark.parametrize("name", METHODS)
def test_the_validation_loss_falls(peft_runs, name):
    rows = [json.loads(line) for line in (peft_runs[name]["out"] / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0] - 1e-3, evals  # the same batches before and after


@pytest.mark.parametrize("name", METHODS)
def test_resume_is_the_straight_run(peft_runs, name, assets, tmp_path):
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    step2 = str(peft_runs[name]["out"] / "checkpoints" / "step-000002")
    with contextlib.redirect_stdout(io.StringIO()):
        run(load_config(None, peft_overrides(assets, tmp_path, name, resume=step2, **{"eval.at_start": "false"}),
                        defaults={}))
    assert losses(tmp_path) == losses(peft_runs[name]["out"])[2:]  # bit for bit


@pytest.mark.parametrize("name", METHODS)
def test_eval_of_the_checkpoint_and_of_final_is_the_run_own_evaluation(peft_runs, name, assets):
    """`shardtune eval` shards the PeftModel like training does: the last checkpoint on the run's
    validation split gives the run's last evaluation, final/ on other data the checkpoint's numbers."""
    from shardtune.evaluation.evaluate import EvalRequest, run_eval

    out = peft_runs[name]["out"]
    ckpt = str(out / "checkpoints" / "step-000003")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    with contextlib.redirect_stdout(io.StringIO()):
        own = run_eval(EvalRequest(model=ckpt, micro_batch_size=2, max_batches=1))["model"]
        data = dict(data=assets["validation"], seq_len=64, max_batches=2)
        from_ckpt = run_eval(EvalRequest(model=ckpt, **data))["model"]
        from_final = run_eval(EvalRequest(model=str(peft_runs[name]["final"]), **data))["model"]
    assert own["eval_loss"] == pytest.approx([r for r in rows if "eval_loss" in r][-1]["eval_loss"], abs=1e-5)
    assert from_final["eval_loss"] == pytest.approx(from_ckpt["eval_loss"], abs=1e-5)
    assert from_final["eval_acc"] == from_ckpt["eval_acc"]


@pytest.mark.parametrize("method", METHODS)
def test_generate_goes_through_the_virtual_tokens(method, assets):
    """peft's generate (cached decoding) picks the tokens a full forward of the adapter model
    ranks first, step by step: the virtual tokens are used in both. Prompts of three lengths: a
    batch left-pads the shorter ones, which must not move their positions (prompt tuning: peft
    ignores position ids, so its prompts go one at a time). GPT-2's absolute positions, made
    large, show a shifted one."""
    import torch
    from transformers import AutoTokenizer

    from shardtune.evaluation.evaluate import generate

    model = _wrapped(method, arch="gpt2").eval()
    tokenizer = AutoTokenizer.from_pretrained(assets["tokenizer"])
    with torch.no_grad():
        model.get_base_model().transformer.wpe.weight.mul_(50.0)
    prompts = [[5, 17, 42, 8, 99, 7, 120, 31, 64, 2, 77, 15], [3, 11], [250, 9, 40]]
    texts = generate(model, tokenizer, prompts, max_new_tokens=4, temperature=0)
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(4):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        assert text == tokenizer.decode(ids[0, len(prompt):], skip_special_tokens=True), prompt


def test_a_bf16_prefix_meets_bf16_keys(assets, tmp_path):
    """Under FSDP's bf16 compute the prefix comes in bf16 too (peft would cast it to the fp32
    shards' dtype, and the attention would refuse fp32 keys beside bf16 queries)."""
    import math

    from conftest import make_trainer, step

    trainer = make_trainer(assets, tmp_path, **{"peft.method": "prefix_tuning", "precision": "bf16"})
    prefetcher = trainer.prefetcher()
    try:
        out = step(trainer, prefetcher.take(0)[0])
    finally:
        prefetcher.close()
        trainer.close()
    assert math.isfinite(float(out.loss_sum)) and float(out.grad_norm) > 0


def _wrapped(method: str, tokenizer: str | None = None, arch: str = "llama", **peft):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    torch.manual_seed(0)
    spec = dict(TINY[arch], vocab_size=300)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    return add_adapter(model, PeftConfig(method=method, num_virtual_tokens=5, **peft), seed=0, tokenizer=tokenizer)


@pytest.mark.parametrize("method", METHODS)
def test_chunked_loss_equals_the_full_logits_loss_and_peft_own(method):
    """A padded batch (attention mask, masked prompt): the same sum, gradient and accuracy with
    the head computing the loss in chunks, with full logits, and from peft's own labels handling."""
    import torch

    from shardtune.model import loss as loss_lib
    from shardtune.train.step import token_loss

    plain = _wrapped(method)
    with torch.no_grad():  # a trained-looking prompt, not peft's init
        plain.prompt_encoder.default.embedding.weight.normal_()
    chunked = copy.deepcopy(plain)
    assert loss_lib.install(chunked, 7) and loss_lib.is_installed(chunked)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, as data.collate pads
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100  # a masked prompt
    b = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss_p, n, _ = token_loss(plain, b)
    loss_c, n_c, _ = token_loss(chunked, b)
    assert int(n) == int(n_c) == 3 * 11 - 3 - 3
    # peft's prompt tuning also asks the last virtual token for the first real one; shardtune
    # predicts the same tokens whatever the method (comparable losses), so that one is masked here
    first_masked = labels.clone()
    first_masked[:, 0] = -100
    with torch.no_grad():
        own = plain(input_ids=ids, attention_mask=mask, labels=first_masked).loss.item() * int(n)
    assert loss_p.item() == pytest.approx(own, rel=1e-6) and loss_c.item() == pytest.approx(own, rel=1e-6)
    loss_p.backward()
    loss_c.backward()
    grad_p, grad_c = (m.prompt_encoder.default.embedding.weight.grad for m in (plain, chunked))
    assert grad_p.abs().sum() > 0 and torch.allclose(grad_p, grad_c, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        assert int(token_loss(plain, b, accuracy=True)[2]) == int(token_loss(chunked, b, accuracy=True)[2])


def test_prompt_init_text_starts_from_the_text_embeddings_of_the_run_tokenizer(assets):
    import torch
    from transformers import AutoTokenizer

    text = "Return the value"
    model = _wrapped("prompt_tuning", prompt_init_text=text, tokenizer=assets["tokenizer"])
    ids = AutoTokenizer.from_pretrained(assets["tokenizer"])(text)["input_ids"]
    ids = (ids * 5)[:5]  # repeated to the number of virtual tokens
    expected = model.get_input_embeddings().weight[ids]
    assert torch.equal(model.prompt_encoder.default.embedding.weight, expected)
    random = _wrapped("prompt_tuning")  # no text: peft's random init
    assert not torch.equal(random.prompt_encoder.default.embedding.weight, expected)


def test_prompt_tuning_takes_the_token_embeddings_width():
    """OPT looks tokens up at word_embed_proj_dim and projects them up to the hidden size: peft's
    random init made the virtual tokens hidden-size wide, and the first forward failed (a shape error)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter
    from shardtune.train.step import token_loss

    spec = dict(TINY["opt"], word_embed_proj_dim=32, vocab_size=300)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    wrapped = add_adapter(model, PeftConfig(method="prompt_tuning", num_virtual_tokens=5), seed=0)
    assert wrapped.prompt_encoder.default.embedding.weight.shape == (5, 32)
    batch = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, n, _ = token_loss(wrapped, {"input_ids": batch, "labels": batch})
    loss.backward()
    assert int(n) == 2 * 11 and wrapped.prompt_encoder.default.embedding.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("extra,needle", [
    ({"peft.method": "prefix_tuning", "activation_checkpointing": "full"}, "activation_checkpointing=none"),
    ({"peft.method": "prompt_tuning", "peft.prompt_init_text": "' '"}, "prompt_init_text is empty"),
    ({"peft.method": "prompt_tuning", "data.document_mask": "true"}, "document mask"),
    ({"peft.method": "prefix_tuning", "peft.num_virtual_tokens": 0}, "peft.num_virtual_tokens"),
    ({"peft.method": "prefix_tuning", "peft.num_virtual_tokens": 65}, "plus peft's 65 virtual tokens"),
    ({"peft.method": "prefix_tuning", "peft.prompt_init_text": "hello"}, "peft.method=prompt_tuning"),
])
def test_what_cannot_work_is_one_line(assets, tmp_path, capsys, extra, needle):
    from shardtune.cli.main import main

    code = main(["train", *tiny_overrides(assets, tmp_path / "bad", **extra)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("model_type,extra", [("gpt_bigcode", {}), ("falcon", {}), ("deepseek_v3", {}),
                                              ("mixtral", {"output_router_logits": True})])
def test_prefix_tuning_is_refused_where_the_model_breaks_it(model_type, extra):
    """Each refusal is needed: the tiny model with peft's prefix fails in its forward (a cache of
    other key/value shapes; the router loss over the lengthened attention mask). Prompt tuning
    and a Mixtral without the router loss pass the check."""
    import torch
    from archs import hf_config
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.errors import UserError
    from shardtune.model.adapters import check_method
    from shardtune.model.prompt_learning import prefix_tuning_config

    config = hf_config(model_type, **extra)
    with pytest.raises(UserError, match="prefix_tuning") as refused:
        check_method(PeftConfig(method="prefix_tuning"), config)
    assert len(str(refused.value).splitlines()) == 1
    check_method(PeftConfig(method="prompt_tuning"), config)
    if extra:
        check_method(PeftConfig(method="prefix_tuning"), hf_config(model_type, output_router_logits=False))
    from peft import get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           prefix_tuning_config(None, PeftConfig(method="prefix_tuning", num_virtual_tokens=2), True))
    ids = torch.randint(2, 300, (2, 6))
    with pytest.raises(RuntimeError):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(2, 4096), seq_len=st.integers(2, 10 ** 6), virtual=st.integers(1, 10 ** 12))
def test_position_advice_is_always_a_setting_that_fits(limit, seq_len, virtual):
    """Whatever the sizes, the numbers check_seq_len advises are settings that fit the model's
    positions (no negative data.seq_len for a huge peft.num_virtual_tokens)."""
    import re
    from types import SimpleNamespace

    from shardtune.errors import UserError
    from shardtune.model.hf import check_seq_len

    try:
        check_seq_len(SimpleNamespace(model_type="gpt2", n_positions=limit), seq_len, virtual)
    except UserError as exc:
        line = str(exc)
        assert seq_len + virtual > limit
        if m := re.search(r"set data.seq_len=(\d+)", line):
            assert 2 <= int(m[1]) and int(m[1]) + virtual <= limit, line
        if m := re.search(r"set peft.num_virtual_tokens=(\d+)", line):
            assert 1 <= int(m[1]) and seq_len + int(m[1]) <= limit, line
        assert "-" not in re.sub(r"[a-z]-[a-z]", "", line), line
        return
    assert seq_len + virtual <= limit
