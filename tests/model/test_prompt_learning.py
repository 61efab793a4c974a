"""Prefix tuning and prompt tuning (peft): only the virtual tokens train, final/ and a
checkpoint's export load with peft unchanged and give the trained model's logits, resume is the
straight run, the chunked loss is the full-logits loss (and peft's own), and what cannot work is
refused in one line."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path

import pytest

from conftest import TINY, losses, tiny_overrides

METHODS = ("prompt_tuning", "prefix_tuning")
SETTINGS = {"peft.num_virtual_tokens": 6, "train.lr": 5e-2, "train.max_steps": 4, "checkpoint.every_steps": 2,
            "eval.max_batches": 2}


def _probe():
    import torch

    return (torch.arange(2 * 16).reshape(2, 16) * 7) % 250


@pytest.fixture(scope="module", params=METHODS)
def prompt_run(request, assets, tmp_path_factory):
    """4 steps of tiny GPT-2 through Trainer, checkpoints at 2 and 4: stdout, the weights before
    and after, the trained model's logits of a probe, final/."""
    import torch

    from shardtune.checkpoint.export import gather_full_state_dict
    from shardtune.config.load import load_config
    from shardtune.train.trainer import Trainer

    method = request.param
    out = tmp_path_factory.mktemp(method)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = Trainer(load_config(None, tiny_overrides(assets, out, **SETTINGS, **{"peft.method": method}),
                                      defaults={}), overwrite=True)
        before = {k: v.clone() for k, v in gather_full_state_dict(trainer.model).items()}
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.fit()
        after = gather_full_state_dict(trainer.model)
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(input_ids=_probe()).logits.detach().clone()
        final = trainer.export()
        trainer.close()
    return {"method": method, "out": out, "final": final, "stdout": printed.getvalue(), "before": before,
            "after": after, "trainable": trainable, "logits": logits}


def test_only_the_virtual_tokens_train_the_share_is_printed_and_the_loss_falls(prompt_run):
    import torch

    line = next(line for line in prompt_run["stdout"].splitlines() if "trainable" in line)
    share = float(re.search(r"trainable, ([0-9.]+)%", line).group(1))
    assert "PeftModel" in line and 0 < share < 2, line
    assert prompt_run["trainable"] == {"prompt_encoder.default.embedding.weight"}
    for name, value in prompt_run["before"].items():
        assert torch.equal(value, prompt_run["after"][name]) == (name not in prompt_run["trainable"]), name
    rows = [json.loads(line) for line in (prompt_run["out"] / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0] - 1e-3, evals  # the same batches before and after


def _peft_logits(adapter: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        return model(input_ids=_probe()).logits


def test_final_and_a_checkpoint_export_load_with_peft_and_give_the_trained_logits(prompt_run, tmp_path, capsys):
    from shardtune.cli.main import main

    final = Path(prompt_run["final"])
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["peft_type"] == prompt_run["method"].upper() and config["num_virtual_tokens"] == 6
    assert (_peft_logits(final) - prompt_run["logits"]).abs().max() < 1e-5
    exported = tmp_path / "export"
    assert main(["export", str(prompt_run["out"] / "checkpoints" / "step-000004"), str(exported)]) == 0
    assert (_peft_logits(exported) - prompt_run["logits"]).abs().max() < 1e-5
    capsys.readouterr()
    # these methods learn tokens, no weights of the base: nothing to merge, and nothing written
    assert main(["export", str(final), str(tmp_path / "merged"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "cannot be merged" in err, err
    assert not (tmp_path / "merged").exists()


def test_resume_is_the_straight_run(prompt_run, assets, tmp_path):
    from shardtune.config.load import load_config
    from shardtune.train.trainer import run

    resume = {**SETTINGS, "peft.method": prompt_run["method"], "eval.at_start": "false",
              "resume": str(prompt_run["out"] / "checkpoints" / "step-000002")}
    with contextlib.redirect_stdout(io.StringIO()):
        run(load_config(None, tiny_overrides(assets, tmp_path, **resume), defaults={}))
    assert losses(tmp_path) == losses(prompt_run["out"])[2:]  # bit for bit


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


def _wrapped(method: str, tokenizer: str | None = None, **peft):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.model.adapters import add_adapter

    torch.manual_seed(0)
    spec = dict(TINY["llama"], vocab_size=300)
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


def test_eval_of_the_checkpoint_and_of_final_is_the_run_own_evaluation(prompt_run, assets):
    """`shardtune eval` shards the PeftModel like training does: a checkpoint on the run's
    validation split gives the run's last evaluation, final/ on the same data the same numbers."""
    from shardtune.train.evaluate import EvalRequest, run_eval

    ckpt = str(prompt_run["out"] / "checkpoints" / "step-000004")
    rows = [json.loads(line) for line in (prompt_run["out"] / "metrics.jsonl").read_text().splitlines()]
    with contextlib.redirect_stdout(io.StringIO()):
        own = run_eval(EvalRequest(model=ckpt, micro_batch_size=2, max_batches=2))["model"]
        data = str(Path(assets["train"]).parent)
        from_ckpt = run_eval(EvalRequest(model=ckpt, data=data, seq_len=64, max_batches=2))["model"]
        from_final = run_eval(EvalRequest(model=str(prompt_run["final"]), data=data, seq_len=64,
                                          max_batches=2))["model"]
    assert own["eval_loss"] == pytest.approx([r for r in rows if "eval_loss" in r][-1]["eval_loss"], abs=1e-5)
    assert from_final["eval_loss"] == pytest.approx(from_ckpt["eval_loss"], abs=1e-5)
    assert from_final["eval_acc"] == from_ckpt["eval_acc"]


def test_generate_goes_through_the_virtual_tokens(prompt_run):
    """peft's generate (cached decoding) picks the tokens a full forward of the adapter model
    ranks first, step by step: the virtual tokens are used in both. Prompts of two lengths: a
    batch left-pads the shorter one, which must not move its positions (prompt tuning: peft
    ignores position ids, so its prompts go one at a time)."""
    import torch

    from shardtune.checkpoint.loading import load_model
    from shardtune.train.evaluate import generate

    model, tokenizer, _, _ = load_model(str(prompt_run["final"]))
    with torch.no_grad():  # positions that decide what comes next: a shifted one shows
        model.get_base_model().transformer.wpe.weight.mul_(50.0)
    prompts = [[5, 17, 42, 8, 99, 7, 120, 31, 64, 2, 77, 15], [3, 11], [250, 9, 40]]
    texts = generate(model, tokenizer, prompts, max_new_tokens=4, temperature=0)
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(4):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        assert text == tokenizer.decode(ids[0, len(prompt):], skip_special_tokens=True), prompt


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
