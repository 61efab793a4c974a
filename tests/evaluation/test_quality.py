"""Generation quality (`shardtune eval --generate`): the scores on texts with known answers,
batched generation equal to one prompt at a time, prompts rendered as training renders them,
the same command giving the same numbers, --compare, the report's chart, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY
from shardtune.cli.main import main
from shardtune.errors import UserError
from shardtune.evaluation import textscores

pytestmark = pytest.mark.usefixtures("single_thread")  # generation is 5x slower with 2 threads here


@pytest.fixture(scope="module")
def models(assets, tmp_path_factory):
    """Two tiny random GPT-2 folders with the corpus tokenizer (seed 0 = "model", 1 = "base")."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    root = tmp_path_factory.mktemp("gen-models")
    cfg = AutoConfig.for_model(**{**TINY["gpt2"], "vocab_size": len(tok), "bos_token_id": tok.eos_token_id,
                                  "eos_token_id": tok.eos_token_id})
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        folder = root / f"seed{seed}"
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return folders


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory) -> Path:
    """An instruct split with the alpaca column names (instruction, input, output)."""
    folder = tmp_path_factory.mktemp("alpaca")
    rows = [{"instruction": f"Name the number after {i}.", "input": "" if i % 2 else f"count {i}",
             "output": f"The number is {i + 1}."} for i in range(6)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def quality(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- scores


def test_scores_on_known_texts():
    same = textscores.score(["the cat sat on the mat"] * 3, ["the cat sat on the mat"] * 3,
                            ["rouge", "bleu", "chrf", "diversity"])
    assert same["rouge1"] == same["rouge2"] == same["rougeL"] == pytest.approx(1.0)
    assert same["bleu"] == pytest.approx(100.0) and same["chrf"] == pytest.approx(100.0)
    assert same["self_bleu"] == pytest.approx(100.0)  # three identical outputs
    assert same["distinct_1"] == pytest.approx(5 / 18)  # the, cat, sat, on, mat of 3 x 6 words
    apart = textscores.score(["alpha beta", "gamma delta"], ["zeta eta", "theta iota"], ["rouge", "diversity"])
    assert apart["rouge1"] == 0 and apart["distinct_1"] == 1.0 and apart["self_bleu"] < 1
    loop = textscores.diversity(["a b c d a b c d a", ""])
    assert loop["rep_4"] == pytest.approx(2 / 6)  # abcd, bcda, cdab, dabc, abcd, bcda: 2 repeats
    assert loop["empty_rate"] == 0.5 and loop["mean_words"] == 4.5


WORDS = "the cat sat on a mat dog ran far away , . !".split()
TEXT = st.lists(st.sampled_from(WORDS), max_size=10).map(" ".join)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(TEXT, TEXT.filter(str.strip)), min_size=1, max_size=5))
def test_scores_are_the_libraries_scores(pairs):
    """Generations against references as rouge-score and sacrebleu score them called directly: ROUGE
    F1 averaged over pairs, corpus BLEU and chrF (hypotheses first: BLEU is not symmetric), self-BLEU
    as each non-empty generation's sentence BLEU against the others; distinct-n counted here."""
    import sacrebleu
    from rouge_score import rouge_scorer

    gens, refs = [g for g, _ in pairs], [r for _, r in pairs]
    got = textscores.score(gens, refs, ["rouge", "bleu", "chrf", "diversity"])
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    for key in ("rouge1", "rouge2", "rougeL"):
        assert got[key] == pytest.approx(sum(scorer.score(r, g)[key].fmeasure for g, r in pairs) / len(pairs))
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(gens, [refs]).score)
    assert got["chrf"] == pytest.approx(sacrebleu.corpus_chrf(gens, [refs]).score)
    said = [g for g in gens if g.strip()]
    others = [sacrebleu.sentence_bleu(g, said[:i] + said[i + 1:]).score for i, g in enumerate(said)] \
        if len(said) > 1 else [0.0]
    assert got["self_bleu"] == pytest.approx(sum(others) / len(others))
    for n in (1, 2, 3):
        grams = [tuple(w[i:i + n]) for w in map(str.split, gens) for i in range(len(w) - n + 1)]
        assert got[f"distinct_{n}"] == pytest.approx(len(set(grams)) / len(grams) if grams else 0.0)


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30),
       st.text(st.characters(max_codepoint=127), max_size=30))
def test_rouge_reads_words_of_any_script(text, ascii_text):
    """A text with a letter or digit scores ROUGE 1 against itself in any script (rouge-score's own
    words are a-z and 0-9 only: Cyrillic scored 0); on ASCII text the words are rouge-score's."""
    from rouge_score import tokenize

    if textscores.RougeWords.tokenize(text):
        assert textscores.rouge([text], [text]) == {"rouge1": 1.0, "rouge2": 1.0 if len(
            textscores.RougeWords.tokenize(text)) > 1 else 0.0, "rougeL": 1.0}
    assert textscores.rouge(["Привет мир, как дела"], ["привет мир"])["rouge1"] == pytest.approx(2 / 3)
    assert textscores.RougeWords.tokenize(ascii_text) == tokenize.tokenize(ascii_text, None)


def unspaced(char: str) -> bool:
    import regex

    return bool(regex.match(f"[{textscores.UNSPACED}]", char))


SPACED = st.characters(categories=("L", "N")).filter(lambda c: not unspaced(c))
# a word starts with a letter or digit: a mark after a Chinese character is that character's
WORD = st.builds(str.__add__, SPACED, st.text(st.characters(categories=("L", "M", "N")).filter(
    lambda c: not unspaced(c)), max_size=5))
HAN_KANA = st.text(st.one_of(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK ideographs, kana
                             st.characters(min_codepoint=0x3041, max_codepoint=0x30FA)).filter(unspaced),
                   min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(st.lists(WORD, min_size=1, max_size=6), st.sampled_from([" ", ", ", "\n", " - "]), HAN_KANA)
def test_rouge_words_keep_their_marks_and_chinese_has_one_a_character(words, sep, han):
    """A word of letters, combining marks and digits is one ROUGE word in any script: `\\w` has no
    marks, and Hindi's vowel signs and viramas cut नमस्ते into नमस, त (ROUGE-1 of नमस्ते against
    नमस्ते दुनिया read 0.57, not 2/3). Chinese and Japanese, written without spaces, have one a
    character (as ROUGE is scored for Chinese): a run of them was one word, so 我爱北京 against
    我爱北京天安门 scored 0."""
    text = sep.join(words)
    assert textscores.RougeWords.tokenize(text) == [w.lower() for w in words]
    assert textscores.RougeWords.tokenize(f"{text}{han}{text}") == [
        *(w.lower() for w in words[:-1]), words[-1].lower(), *han, words[0].lower(), *(w.lower() for w in words[1:])]
    assert textscores.rouge(["नमस्ते"], ["नमस्ते दुनिया"])["rouge1"] == pytest.approx(2 / 3)
    assert textscores.rouge(["我爱北京"], ["我爱北京天安门"])["rouge1"] == pytest.approx(8 / 11)


ACCENTED = st.text(st.sampled_from("aeinouécèñçåøüǖ ,.-") | st.characters(exclude_categories=("Cs",)), max_size=20)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(ACCENTED, ACCENTED, st.sampled_from(["NFC", "NFD"]), st.sampled_from(["NFC", "NFD"])),
                min_size=1, max_size=3))
def test_canonically_equal_texts_score_as_equal(pairs):
    """A generation decoded by a normalizing tokenizer (Qwen2's NFC) against a reference of the
    same text in another Unicode form (e + U+0301) scores as the same text: every metric read
    "café crème naïve" against itself decomposed as ROUGE 0 and chrF 23."""
    from unicodedata import normalize

    metrics = ["rouge", "bleu", "chrf", "diversity"]
    got = textscores.score([normalize(f, g) for g, _, f, _ in pairs], [normalize(f, r) for _, r, _, f in pairs],
                           metrics)
    assert got == pytest.approx(textscores.score([normalize("NFC", g) for g, *_ in pairs],
                                                 [normalize("NFC", r) for _, r, *_ in pairs], metrics))
    same = textscores.score(["café crème naïve"], [normalize("NFD", "café crème naïve")], metrics)
    assert same["rouge1"] == same["chrf"] / 100 == pytest.approx(1.0)


def test_metric_names_are_checked():
    assert textscores.parse_metrics("bleu, rouge,bleu") == ["bleu", "rouge"]
    with pytest.raises(UserError, match="unknown metric 'bleurt'"):
        textscores.parse_metrics("rouge,bleurt")


# ----------------------------------------------------------------------------- generation


def test_batched_generation_equals_one_prompt_at_a_time(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.evaluation.evaluate import generate

    model = AutoModelForCausalLM.from_pretrained(models[0]).eval()
    tok = AutoTokenizer.from_pretrained(models[0])
    prompts = ["Return the", "The value of the given object, if any,", "", [5, 6, 7]]
    alone = [generate(model, tok, [p], max_new_tokens=6, temperature=0)[0] for p in prompts]
    assert generate(model, tok, prompts, max_new_tokens=6, temperature=0, batch_size=4) == alone


def test_text_prompts_are_deterministic_compare_and_report(assets, models, tmp_path, capsys):
    data = str(Path(assets["train"]).parent)
    argv = [str(models[0]), "--generate", "4", "--data", data, "--split", "train", "--prompt-tokens", "8",
            "--max-new-tokens", "6", "--temperature", "0.1", "--seed", "3", "--micro-batch-size", "2",
            "--compare", str(models[1])]  # sampled: at 1.0 two near-uniform random models draw alike tokens
    code, out, _ = quality([*argv, "--out", str(tmp_path / "a" / "generation.json")], capsys)
    assert code == 0 and "fine-tuned" in out and "base" in out and "--- example 1" in out
    (tmp_path / "b.json").write_text((tmp_path / "a" / "generation.json").read_text())  # its own: replaced
    code, _, _ = quality([*argv, "--out", str(tmp_path / "b.json")], capsys)
    first = json.loads((tmp_path / "a" / "generation.json").read_text())
    second = json.loads((tmp_path / "b.json").read_text())
    assert first["examples"] == second["examples"] and len(first["examples"]) == 4
    for role in ("model", "base"):
        assert first["models"][role]["scores"] == second["models"][role]["scores"]
    assert first["examples"][0]["model"] != first["examples"][0]["base"]  # two models, side by side
    scores = first["models"]["model"]["scores"]
    assert {"rouge1", "rougeL", "bleu", "chrf", "distinct_2", "self_bleu", "rep_4", "mean_words"} <= set(scores)
    # the references are the documents' true next tokens after the K-token prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    doc = json.loads(Path(assets["train"]).read_text().splitlines()[0])["text"]  # --data's train split, row 0
    ids = tok(doc, add_special_tokens=False)["input_ids"]
    assert first["examples"][0]["reference"] == tok.decode(ids[8:14])
    assert first["examples"][0]["prompt"] == tok.decode(ids[:8])

    assert main(["report", str(tmp_path / "a"), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Generation quality: a" in text and (tmp_path / "report" / "generation-a.png").stat().st_size > 1000


def test_a_base_of_another_tokenizer_reads_the_prompt_as_its_training_did(assets, models, tmp_path, capsys):
    """--compare with a base whose vocabulary is another (a Llama-style one that starts text with
    <s>) gets the prompt's text in its own tokens after its own BOS, as its training read text and
    as plain transformers' tokenizer(prompt) gives it: it was given no BOS, and generated otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import llama_tokenizer
    from shardtune.evaluation.evaluate import continuation

    tok = llama_tokenizer()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY["llama"], "vocab_size": len(tok)})).eval()
    base.save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    out = tmp_path / "gen.json"
    code, _, _ = quality([str(models[0]), "--generate", "2", "--data", str(Path(assets["train"]).parent), "--split",
                          "train", "--prompt-tokens", "8", "--max-new-tokens", "5", "--metrics", "rouge",
                          "--compare", str(tmp_path / "llama"),
                          "--out", str(out)], capsys)
    assert code == 0
    for example in json.loads(out.read_text())["examples"]:
        ids = tok(example["prompt"]).input_ids
        assert ids[0] == tok.bos_token_id
        with torch.no_grad():
            new = base.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        new = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        assert example["base"] == continuation(tok, ids, new)


def test_instruct_prompts_are_the_training_prompts(models, alpaca, tmp_path, capsys):
    from shardtune.data.formats import PROMPT_NO_INPUT, PROMPT_WITH_INPUT

    out = tmp_path / "gen.json"
    code, stdout, _ = quality([str(models[0]), "--generate", "10", "--data", str(alpaca), "--format", "instruct",
                               "--max-new-tokens", "4", "--metrics", "rouge,diversity", "--out", str(out)], capsys)
    assert code == 0 and "only 6 usable example(s)" in stdout
    result = json.loads(out.read_text())
    first, second = result["examples"][:2]
    assert first["prompt"] == PROMPT_WITH_INPUT.format(instruction="Name the number after 0.", input="count 0")
    assert second["prompt"] == PROMPT_NO_INPUT.format(instruction="Name the number after 1.")
    assert first["reference"] == "The number is 1."
    assert set(result["models"]["model"]["scores"]) >= {"rouge1", "distinct_1"}
    assert "bleu" not in result["models"]["model"]["scores"]


@settings(max_examples=10, deadline=None)
@given(outputs=st.lists(st.lists(TEXT.filter(str.strip), min_size=1, max_size=3), min_size=1, max_size=3),
       sep=st.sampled_from([" ", "\n", ", ", " | "]))
def test_an_instruct_prompt_and_reference_are_the_training_example(assets, outputs, sep):
    """`eval --generate` compares a generation with the response training scored: a list-valued
    output joined with the run's data.list_sep (the reference joined it with a space)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from shardtune.config.schema import DataConfig
    from shardtune.data.formats import instruct_fn
    from shardtune.evaluation.quality import QualityRequest, examples

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    cfg = DataConfig(format="instruct", list_sep=sep, seq_len=4096)
    rows = [{"instruction": f"say {i}", "input": "", "output": o} for i, o in enumerate(outputs)]
    docs = Dataset.from_list(rows)
    found = examples(QualityRequest(model="m", generate=len(rows)), cfg, docs, tok)
    trained = instruct_fn(cfg, tok, docs.column_names, "d")(docs[:])
    for ex, ids, labels in zip(found, trained["input_ids"], trained["labels"], strict=True):
        response = [t for t in labels if t != -100][:-1]  # before its EOS
        assert ids == ex.prompt_ids + response + [tok.eos_token_id]
        assert ex.reference == tok.decode(response)



@pytest.mark.parametrize("add_eos", [False, True])
def test_a_text_prompt_is_the_start_of_its_training_document(add_eos):
    """`eval --generate`'s text prompt is the document's first tokens as training packed them: a
    llama-style BOS first (none before, so the model was asked to continue a text it never saw
    begin that way)."""
    from datasets import Dataset

    from conftest import llama_tokenizer
    from shardtune.config.schema import DataConfig
    from shardtune.data.pipeline import pack
    from shardtune.evaluation.quality import QualityRequest, examples

    tok, docs = llama_tokenizer(add_eos), Dataset.from_list([{"text": "The capital of France is Paris"}])
    request = QualityRequest(model="m", generate=1, prompt_tokens=3, max_new_tokens=2)
    [ex] = examples(request, DataConfig(), docs, tok)
    trained = pack(docs, tok, "text", 1)[:]["input_ids"].flatten().tolist()
    assert ex.prompt_ids == trained[:3] and trained[0] == tok.bos_token_id  # --prompt-tokens counts it
    assert (ex.prompt, ex.prompt + ex.reference) == (tok.decode(trained[1:3]), tok.decode(trained[1:5]))


def test_chat_prompt_ends_with_the_generation_prompt(assets):
    from transformers import AutoTokenizer

    from shardtune.data.chat import chat_prompt_and_reply

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert chat_prompt_and_reply(tok, messages, 0, "messages") == (
        "<user>hi\n<assistant>hello\n<user>2+2?\n<assistant>", "4")
    assert chat_prompt_and_reply(tok, messages[:1], 1, "messages") is None


# a Qwen3-style template (the last reply opens with an empty <think></think>), a Llama-3-style one
# (content trimmed), ChatML
REPLY_TEMPLATES = {
    "qwen3": "{% for m in messages %}{% if m.role == 'assistant' and loop.last %}<|im_start|>assistant\n<think>\n\n"
             "</think>\n\n{{ m.content }}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
             "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "trimmed": "{% for m in messages %}<|im_start|>{{ m.role }}\n\n{{ m.content | trim }}<|im_end|>{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}",
    "chatml": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}


@pytest.mark.parametrize("template", REPLY_TEMPLATES)
@pytest.mark.parametrize("reply", ["Paris", " Paris is the capital \n", "日本語 café"])
def test_a_chat_reference_is_the_reply_training_taught(assets, template, reply):
    """A chat row's reference is the last reply as training labels it, decoded as a generation is:
    a model that writes exactly its training labels scores ROUGE 1. The message's content was the
    reference, and a Qwen3-style model's exact "<think>\n\n</think>\n\nParis" scored ROUGE-1 0.5."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from shardtune.config.schema import DataConfig
    from shardtune.data import chat
    from shardtune.data.formats import IGNORE_INDEX
    from shardtune.evaluation.evaluate import before, continuation, until
    from shardtune.evaluation.quality import QualityRequest, examples

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])  # byte-level: <think> is plain text, kept by decode
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    cfg = DataConfig(format="chat", chat_template=REPLY_TEMPLATES[template])
    messages = [{"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": reply}]
    docs = Dataset.from_list([{"messages": messages}])
    [ex] = examples(QualityRequest(model="m", generate=1, max_new_tokens=40), cfg, docs, tok)
    trained = chat.chat_fn(cfg, tok, docs.column_names, "docs")({"messages": [messages]}, [0])
    ids, labels = trained["input_ids"][0], trained["labels"][0]
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    ends = chat.trained_ends(cfg, tok)
    written = before(continuation(tok, ids[:first], until(ids[first:], [e for e in ends if isinstance(e, int)])),
                     [e for e in ends if isinstance(e, str)])  # what generate returns for a model that writes them
    assert ex.prompt_ids == ids[:first]
    assert ex.reference == written
    assert textscores.rouge([written], [ex.reference])["rouge1"] == pytest.approx(1.0)


@pytest.mark.parametrize("extra, needle", [
    (["--generate", "0"], "--generate: must be at least 1"),
    (["--generate", "2", "--metrics", "rouge,bleurt"], "unknown metric 'bleurt'"),
    (["--generate", "2", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["--generate", "2", "--format", "instruct", "--prompt-tokens", "8"], "--prompt-tokens applies only to text"),
    (["--generate", "2", "--top-p", "0"], "--top-p"),
    (["--generate", "2", "--nproc", "2"], "one process"),
])
def test_bad_input_is_one_line_before_generating(models, tmp_path, capsys, extra, needle):
    code, _, err = quality([str(models[0]), "--data", str(tmp_path), *extra, "--out", str(tmp_path / "g.json")],
                           capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "g.json").exists()


def test_a_users_file_is_not_replaced_by_generations(models, tmp_path, capsys):
    """--out naming a file `eval --generate` did not write: refused before any model loads, the file
    unchanged; --overwrite is how to replace it on purpose."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code, _, err = quality([str(models[0]), "--generate", "2", "--data", str(tmp_path), "--out", str(notes)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is not an output of `eval --generate`" in lines[0], err
    assert "--overwrite" in lines[0] and notes.read_text() == "my notes\n"


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_runs_own_files_are_not_replaced_by_generations_even_with_overwrite(models, tmp_path, capsys, name):
    """--overwrite replaces a file of eval --generate's own, not the record of the run it reads."""
    run = tmp_path / "run"
    run.mkdir()
    for mark in ("config.yaml", "metrics.jsonl"):
        (run / mark).write_text(f"the run's {mark}\n")
    code, _, err = quality([str(models[0]), "--generate", "2", "--data", str(tmp_path), "--out", str(run / name),
                            "--overwrite"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"is the {name} of the run in" in lines[0], err
    assert (run / name).read_text() == f"the run's {name}\n"


def test_mauve_without_its_extra_says_how_to_get_it(capsys, models):
    try:
        import mauve  # noqa: F401
        pytest.skip("mauve-text is installed")
    except ImportError:
        pass
    code, _, err = quality([str(models[0]), "--generate", "2", "--metrics", "mauve", "--mauve-featurizer", "gpt2"],
                           capsys)
    assert code == 2 and "pip install 'shardtune[mauve]'" in err and len(err.strip().splitlines()) == 1


def test_mauve_end_to_end_separates_and_repeats(assets, models, capsys, tmp_path):
    """With the extra installed: a text set scores high against itself, far lower against unrelated text,
    and the CLI gives the same MAUVE twice (seeded PCA and k-means). The featurizer's folder name has
    no "gpt2" (mauve-text's own loader would refuse it), an empty generation is scored (mauve-text
    drops empty texts), one longer than the featurizer's positions is cut to them, and mauve-text's
    progress bar stays off the console."""
    pytest.importorskip("mauve")
    featurizer = textscores.load_featurizer(str(models[1]))
    texts = [f"Return the value number {i} of the given object." for i in range(20)]
    junk = ["", "zq " * 400] + ["zq " * (3 + i % 5) for i in range(2, 20)]  # longer than the featurizer's 128 positions
    assert "gpt2" not in str(models[1])
    same = textscores.mauve_score(texts, texts, featurizer)["mauve"]
    apart = textscores.mauve_score(junk, texts, featurizer)["mauve"]
    # not 1.0: mauve-text 0.4.0 gives 0.75 for equal histograms (ties in its divergence curve's sort)
    assert same >= 0.75 and apart < 0.05, (same, apart)
    argv = [str(models[0]), "--generate", "4", "--data", str(Path(assets["train"]).parent), "--split", "train",
            "--prompt-tokens", "8", "--max-new-tokens", "4", "--metrics", "mauve",
            "--mauve-featurizer", str(models[1]), "--seed", "1"]
    runs = []
    capsys.readouterr()  # the library calls' bars above: the CLI's console is checked below
    for name in ("a.json", "b.json"):
        code, _, err = quality([*argv, "--out", str(tmp_path / name)], capsys)
        assert code == 0 and "Featurizing" not in err, err
        runs.append(json.loads((tmp_path / name).read_text())["models"]["model"]["scores"]["mauve"])
    assert 0 < runs[0] <= 1 and runs[0] == runs[1]


def test_a_missing_metric_package_names_its_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "rouge_score", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'shardtune\[quality\]'"):
        textscores.parse_metrics("bleu,rouge")


@pytest.mark.parametrize("rows, extra, needle", [
    ([{"text": 123456789}] * 8, [], "holds int64"),
    ([{"text": "words " * 40}] * 8 + [{"text": {"a": "b"}}], [], "mixes text with other values"),
    ([{"instruction": "say", "output": None}] * 8, ["--format", "instruct"], "null or empty in all 8 rows"),
])
def test_columns_that_hold_no_text_are_refused_as_in_training(models, tmp_path, capsys, rows, extra, needle):
    """eval --generate reads its prompts and references through training's check of the columns:
    an int column was a traceback, a record or a null prompted and scored as its repr."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = quality([str(models[0]), "--generate", "2", "--data", str(data), *extra,
                            "--out", str(tmp_path / "g.json")], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "g.json").exists()
