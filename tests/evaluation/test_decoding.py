"""How `generate` and `eval --generate` decode: the new tokens' text as it reads after the prompt
(a SentencePiece tokenizer's word spaces, a byte-level one's characters cut at the prompt's end)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.evaluation.evaluate import continuation, generate, until

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["The", "capital", "of", "France", "is", "Paris", "café", "naïve", "日本語", "テキスト", "🙂", "x=1;", "\n"]


@functools.cache
def metaspace_tokenizer():
    """A Llama-2/Mistral-style tokenizer (BPE over `▁`-marked words, byte fallback): its decoder
    drops the `▁` space of the first token it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=[
        "<unk>", "<s>", "</s>"], initial_alphabet=[f"<0x{b:02X}>" for b in range(256)]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@functools.cache
def byte_level_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join), st.integers(0, 40), st.booleans())
def test_new_tokens_read_as_they_do_after_the_prompt(assets, text, cut, metaspace):
    """Prompt ids then new ids: the new text is what the whole adds to the prompt's text (less a
    character the prompt's last bytes began): decoded alone, `is` + `Paris` read `isParis` on a
    SentencePiece tokenizer and a character cut in two was two U+FFFD on a byte-level one."""
    tok = metaspace_tokenizer() if metaspace else byte_level_tokenizer(assets["tokenizer"])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cut = min(cut, len(ids))
    head = tok.decode(ids[:cut]).rstrip("\ufffd")
    assert head + continuation(tok, ids[:cut], ids[cut:]) == tok.decode(ids)


def test_generate_prints_the_prompt_and_the_text_the_model_wrote():
    """generate's texts after their prompts equal transformers' decoding of the whole output on a
    SentencePiece tokenizer (a Llama with it): the word after the prompt keeps its space."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = metaspace_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type="llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, vocab_size=len(tok), bos_token_id=1,
        eos_token_id=2)).eval()
    prompts = ["The capital of France is", "café naïve"]
    for prompt, text in zip(prompts, generate(model, tok, prompts, max_new_tokens=6, temperature=0), strict=True):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        whole = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=2)[0]
        assert prompt + text == tok.decode(whole, skip_special_tokens=True)



def test_a_prompt_cut_to_the_models_positions_keeps_its_bos():
    """A prompt too long for the model keeps its end, where the answer starts, and the BOS that
    every training example started with (a llama-style tokenizer's); without one, only its end."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import llama_tokenizer

    tok = llama_tokenizer()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type="llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, vocab_size=len(tok), bos_token_id=1, eos_token_id=2)).eval()
    seen, real = [], model.generate
    model.generate = lambda ids, **kw: seen.append(ids.tolist()) or real(ids, **kw)
    ids = tok("The capital of France is Paris " * 4)["input_ids"]
    generate(model, tok, [ids, ids[1:], ids[:9]], max_new_tokens=4, temperature=0, batch_size=1)
    assert ids[0] == tok.bos_token_id and len(ids) > 16
    assert seen == [[ids[:1] + ids[-11:]], [ids[-12:]], [ids[:9]]]


def test_a_text_documents_prompt_and_reference_are_its_text():
    """eval --generate's reference of a text document is decoded after its prompt, as the
    generations are: prompt + reference is the document's text."""
    from datasets import Dataset

    from shardtune.config.schema import DataConfig
    from shardtune.evaluation.quality import QualityRequest, examples

    text = "The capital of France is Paris café naïve"
    req = QualityRequest(model="m", generate=1, prompt_tokens=6, max_new_tokens=200)
    [ex] = examples(req, DataConfig(format="text", path="docs"), Dataset.from_dict({"text": [text]}),
                    metaspace_tokenizer())
    assert ex.prompt + ex.reference == text


@pytest.fixture(scope="module")
def gpt2(assets):
    """A tiny random GPT-2 on the corpus tokenizer whose generation_config.json asks for a decoding
    of its own (as hub models' files do): repetition penalty, no repeated tokens, beams, top-k 1, and
    two sequences per prompt in a dict (each a traceback in generate before)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY

    tok = byte_level_tokenizer(assets["tokenizer"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{
        **TINY["gpt2"], "vocab_size": len(tok), "bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id}))
    model.generation_config.update(repetition_penalty=10.0, no_repeat_ngram_size=1, num_beams=2, top_k=1, min_p=0.5,
                                   num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    return model.eval(), tok


def test_greedy_is_the_likeliest_token_whatever_the_models_generation_config(gpt2):
    """--temperature 0 is argmax decoding, step by step by hand, not the model file's beams and penalties."""
    model, tok = gpt2
    ids = tok("Return the value", add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(8):
            new.append(int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax()))
    assert generate(model, tok, ["Return the value"], max_new_tokens=8, temperature=0) == \
        [continuation(tok, ids, new)]


# settings of a generation_config.json that reached generate past the old list of ones turned off:
# each changed a greedy output (suppressed or forced tokens, a length penalty) or was a traceback
# (decoding strategies moved to the Hub, stop strings without a tokenizer, assisted decoding in a batch)
FILE_SETTINGS = [dict(suppress_tokens=list(range(200))), dict(begin_suppress_tokens=list(range(200))),
                 dict(forced_eos_token_id=5), dict(exponential_decay_length_penalty=(1, 5.0)),
                 dict(stop_strings=["e"]), dict(penalty_alpha=0.6, top_k=4), dict(dola_layers="high"),
                 dict(prompt_lookup_num_tokens=3), dict(do_sample=True, temperature=5.0, top_k=3)]


@pytest.mark.parametrize("asked", FILE_SETTINGS, ids=lambda s: next(iter(s)))
def test_no_setting_of_the_models_file_shapes_greedy_decoding(gpt2, asked):
    """Whatever decoding the model's generation_config.json asks for, --temperature 0 gives the
    argmax tokens of a plain forward, in a batch, and the model keeps its file's settings."""
    from transformers import GenerationConfig

    model, tok = gpt2
    prompts = ["Return the value", "The"]
    saved = model.generation_config
    model.generation_config = GenerationConfig(**{**saved.to_dict(), **asked})
    try:
        expected = []
        for prompt in prompts:
            ids, new = tok(prompt, add_special_tokens=False)["input_ids"], []
            with torch.no_grad():
                for _ in range(6):
                    new.append(int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax()))
            expected.append(continuation(tok, ids, until(new, [tok.eos_token_id])))
        assert generate(model, tok, prompts, max_new_tokens=6, temperature=0, batch_size=2) == expected
        assert model.generation_config.to_dict() == GenerationConfig(**{**saved.to_dict(), **asked}).to_dict()
    finally:
        model.generation_config = saved


def test_sampling_at_top_p_1_draws_from_the_whole_vocabulary(gpt2):
    """--top-p 1 at a high temperature draws nearly uniformly from all tokens: transformers' own
    top-k of 50 (or the model file's top-k 1 and min-p) kept it to the 50 likeliest at most."""
    model, tok = gpt2
    texts = generate(model, tok, ["Return the value"] * 400, max_new_tokens=1, temperature=1e4, top_p=1.0,
                     batch_size=400)
    assert len(set(texts)) > 80, sorted(set(texts))  # ~127 of the ~172 tokens that decode alone to a text of their own


# ----------------------------------------------------------------------------- where an answer ends

# chat templates whose end of turn is no EOS of the tokenizer's: ChatML (Qwen's), Llama 3's, Gemma's as
# special tokens; a template's own end marker in a tokenizer without it, several tokens of text
TURN_ENDS = {
    "<|im_end|>": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "<|eot_id|>": "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
                  "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                  "<|end_header_id|>\n\n{% endif %}",
    "<end_of_turn>": "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
                     "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "[END]": "{% for m in messages %}{{ m.role }}: {{ m.content }} [END]\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}",
}

def bigram_model(tok, pairs: dict):
    """A tiny Llama whose blocks add nothing, so the last token alone picks the next: {token: next}."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{
        **TINY["llama"], "vocab_size": len(tok), "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id}))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        head.zero_()
        for a, b in pairs.items():
            head[b] += 10 * emb[a] / emb[a].norm()
    return model.eval()


@pytest.mark.parametrize("end", list(TURN_ENDS))
def test_a_chat_answer_ends_at_the_templates_end_of_turn(assets, tmp_path, end, capsys):
    """Training labels the template's end of turn as a reply's last token; generation went on past
    it (the model's EOS is another token) and wrote turns of its own, in `generate` and in the
    replies `eval --generate` scores."""
    import json

    from transformers import AutoTokenizer

    from shardtune.cli.main import main

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    tok.add_special_tokens({"additional_special_tokens": sorted(set(re.findall(r"<[|\w]+>", TURN_ENDS[end])))})
    tok.chat_template = TURN_ENDS[end]
    word, after = (tok(w, add_special_tokens=False).input_ids[-1] for w in (" Paris", " user"))
    last = tok(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids[-1]
    chain = [last, word, *tok(end, add_special_tokens=False).input_ids, after, after]
    assert len(set(chain)) == len(chain) - 1  # a bigram model says it: every token but the last once
    bigram_model(tok, dict(zip(chain[:-1], chain[1:], strict=True))).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    reply = tok.decode([word])
    assert main(["generate", str(tmp_path / "m"), "--format", "chat", "--prompt", "hi", "--prompt", "a longer one",
                 "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.count(reply + "\n") == 2
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]} for q in "ab"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--format", "chat", "--generate", "2",
                 "--max-new-tokens", "12", "--metrics", "rouge", "--out", str(tmp_path / "g.json")]) == 0
    result = json.loads((tmp_path / "g.json").read_text())
    assert [e["model"] for e in result["examples"]] == [reply, reply]
    assert result["models"]["model"]["scores"]["rouge1"] == pytest.approx(1.0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_batched_generation_of_a_mixture_of_experts_with_its_router_loss(assets, arch):
    """A model trained with its router loss (output_router_logits in its config) computed that loss
    in each decoding step over the whole padded mask: a traceback once prompts of two lengths met."""
    from archs import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    assert model.config.output_router_logits
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21], [30, 31, 32]]
    alone = [generate(model, tok, [p], max_new_tokens=4, temperature=0)[0] for p in prompts]
    assert generate(model, tok, prompts, max_new_tokens=4, temperature=0, batch_size=3) == alone
