"""Scores of generated text: against references (ROUGE-1/2/L from `rouge-score`, BLEU and chrF
from `sacrebleu`), reference-free diversity and degeneration (distinct-n, self-BLEU, repetition
rate, mean length), and MAUVE where its GPL-licensed extra is installed. Pure functions of the
texts: the same texts give the same numbers. Nothing here downloads (rouge-score's tokenizer is a
regular expression, its stemmer is off; sacrebleu's 13a tokenizer needs no data)."""

from __future__ import annotations

import importlib
import random
import unicodedata

from shardtune.errors import UserError

METRICS = ("rouge", "bleu", "chrf", "diversity", "mauve")
DEFAULT_METRICS = ("rouge", "bleu", "chrf", "diversity")
SELF_BLEU_SAMPLE = 200  # self-BLEU is quadratic in the generations: scored over a seeded sample of this many
MAUVE_HINT = "pip install 'shardtune[mauve]' (mauve-text, GPL-licensed)"
QUALITY_HINT = "pip install 'shardtune[quality]'"
PACKAGES = {"rouge": ("rouge_score", QUALITY_HINT), "bleu": ("sacrebleu", QUALITY_HINT),
            "chrf": ("sacrebleu", QUALITY_HINT), "diversity": ("sacrebleu", QUALITY_HINT),  # self-BLEU
            "mauve": ("mauve", MAUVE_HINT)}


def parse_metrics(text: str) -> list[str]:
    """`rouge,bleu` -> ["rouge", "bleu"], refusing names it does not know."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise UserError(f"unknown metric {unknown[0] if unknown else text!r} in --metrics; choose from "
                        f"{', '.join(METRICS)}")
    for name in names:
        module, hint = PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise UserError(f"--metrics {name} needs the {module!r} package: {hint}") from None
    return list(dict.fromkeys(names))


def words(text: str) -> list[str]:
    return text.split()


def ngrams(tokens: list[str], n: int) -> list[tuple]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


# scripts written without spaces between words: each character is a ROUGE word, as ROUGE is
# computed for Chinese (and sacrebleu's zh tokenizer splits); a run of them was one "word" and
# 我爱北京 against 我爱北京天安门 scored 0
UNSPACED = r"\p{Han}\p{Hiragana}\p{Katakana}"


class RougeWords:
    """ROUGE's words: runs of letters, combining marks and digits of any script, lowercased; in
    Chinese and Japanese each character. rouge-score's own tokenizer keeps only a-z and 0-9, so
    Cyrillic, Greek or CJK text scored 0 against itself (and café was caf); a word's marks are part
    of it (Hindi's vowel signs and viramas, Thai's vowels, a decomposed é: `\\w` has none, and cut
    नमस्ते into नमस, त). On ASCII text the words are rouge-score's. `regex` comes with transformers."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        import regex

        return regex.findall(rf"[{UNSPACED}]\p{{M}}*|(?:(?![{UNSPACED}])[\p{{L}}\p{{M}}\p{{N}}])+", text.lower())


def rouge(generations: list[str], references: list[str]) -> dict:
    """Mean ROUGE-1/2/L F-measure, in [0, 1]."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False, tokenizer=RougeWords())
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for gen, ref in zip(generations, references):
        for key, score in scorer.score(ref, gen).items():
            totals[key] += score.fmeasure
    return {k: v / max(len(generations), 1) for k, v in totals.items()}


def bleu(generations: list[str], references: list[str]) -> dict:
    """Corpus BLEU (0-100), sacrebleu's defaults."""
    from sacrebleu.metrics import BLEU

    return {"bleu": BLEU().corpus_score(generations, [references]).score}


def chrf(generations: list[str], references: list[str]) -> dict:
    from sacrebleu.metrics import CHRF

    return {"chrf": CHRF().corpus_score(generations, [references]).score}


def self_bleu(generations: list[str], seed: int = 0) -> float:
    """Mean BLEU (0-100) of each generation against all the others: high = the outputs look
    alike. Over a seeded sample of SELF_BLEU_SAMPLE generations when there are more."""
    from sacrebleu.metrics import BLEU

    texts = [g for g in generations if g.strip()]
    if len(texts) < 2:
        return 0.0
    if len(texts) > SELF_BLEU_SAMPLE:
        texts = random.Random(seed).sample(texts, SELF_BLEU_SAMPLE)
    metric = BLEU(effective_order=True)
    scores = [metric.sentence_score(t, texts[:i] + texts[i + 1:]).score for i, t in enumerate(texts)]
    return sum(scores) / len(scores)


def diversity(generations: list[str], seed: int = 0) -> dict:
    """distinct-n: unique n-grams over all n-grams of all generations (low = the model says the
    same things); rep-n: the share of each generation's n-grams that repeat an earlier one of the
    same generation (high = loops), averaged; mean length in words; the share of empty outputs."""
    tokens = [words(g) for g in generations]
    out = {}
    for n in (1, 2, 3):
        grams = [g for t in tokens for g in ngrams(t, n)]
        out[f"distinct_{n}"] = len(set(grams)) / len(grams) if grams else 0.0
    reps = []
    for t in tokens:
        grams = ngrams(t, 4)
        if grams:
            reps.append(1 - len(set(grams)) / len(grams))
    out["rep_4"] = sum(reps) / len(reps) if reps else 0.0
    out["self_bleu"] = self_bleu(generations, seed)
    out["mean_words"] = sum(map(len, tokens)) / max(len(tokens), 1)
    out["empty_rate"] = sum(1 for t in tokens if not t) / max(len(tokens), 1)
    return out


def load_featurizer(name: str):
    """(model, tokenizer) of a MAUVE featurizer from a local folder or the local hub cache only:
    a hub id not downloaded yet is refused, never fetched. Ours, not mauve-text's loader, which
    takes only names containing "gpt2" or "bert" and fetches from the hub (BENCHMARKS.md, issue 35)."""
    from transformers import AutoModel, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        model = AutoModel.from_pretrained(name, local_files_only=True).eval()
    except (OSError, ValueError):
        raise UserError(f"MAUVE featurizer {name!r} is not available offline; give a local model folder, or "
                        f"fetch it first with `shardtune download model:{name}`") from None
    return model, tok


def mauve_score(generations: list[str], references: list[str], featurizer, seed: int = 0,
                max_tokens: int = 256) -> dict:
    """mauve-text featurises (the last hidden state at each text's last token) and scores. An
    empty generation is its EOS, not dropped as mauve-text drops empty texts: it counts."""
    import mauve
    from mauve.utils import featurize_tokens_from_model

    from shardtune.model.hf import max_positions

    model, tok = featurizer
    limit = min(max_tokens, max_positions(model.config) or max_tokens)

    def features(texts: list[str]):
        ids = [tok(t or tok.eos_token or " ", return_tensors="pt", truncation=True, max_length=limit).input_ids
               for t in texts]
        return featurize_tokens_from_model(model, ids, batch_size=8).float().numpy()

    result = mauve.compute_mauve(p_features=features(references), q_features=features(generations),
                                 seed=seed, verbose=False)
    return {"mauve": float(result.mauve)}


def score(generations: list[str], references: list[str] | None, metrics: list[str], seed: int = 0,
          featurizer=None) -> dict:
    """Every asked metric that applies (reference metrics need references). Texts are compared in
    one Unicode form (NFC): a tokenizer that normalizes (Qwen2's NFC) decodes é as one code point
    where a reference may hold e + U+0301, the same text, which every metric read as different."""
    generations = [unicodedata.normalize("NFC", t) for t in generations]
    if references is not None:
        references = [unicodedata.normalize("NFC", t) for t in references]
    out = {}
    if references is not None:
        if "rouge" in metrics:
            out.update(rouge(generations, references))
        if "bleu" in metrics:
            out.update(bleu(generations, references))
        if "chrf" in metrics:
            out.update(chrf(generations, references))
        if "mauve" in metrics:
            out.update(mauve_score(generations, references, featurizer, seed))
    if "diversity" in metrics:
        out.update(diversity(generations, seed))
    return out
