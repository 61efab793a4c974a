"""`shardtune export`, `eval` and `generate` on a tiny trained run: the export loads with plain
`from_pretrained` and gives the same logits; eval's numbers equal a hand computation with plain
transformers (on 1 and 2 ranks); generate matches `model.generate`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from test_checkpoint import (  # noqa: F401
    ck_assets,
    cli,
    config,
    one_line_error,
    one_thread,
    overrides,
    release_group,
    spawn,
)

from shardtune.cli.main import build_parser, main

SEQ = 64
PROBE = torch.arange(48).reshape(3, 16) % 250


@pytest.fixture(scope="module")
def trained(ck_assets, tmp_path_factory):  # noqa: F811
    """A 6-step run with final/ and checkpoints/step-000006 (same weights), plus a random-init
    HF folder to compare against."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.train.trainer import run

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("trained")
    run(config(ck_assets, out, **{"train.max_steps": 6, "checkpoint.every_steps": 6}))
    release_group()
    base = out.parent / "base-model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(out / "final").config).save_pretrained(base)
    AutoTokenizer.from_pretrained(out / "final").save_pretrained(base)
    return out


def logits(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=PROBE).logits


def hand_metrics(folder: Path, jsonl: str) -> dict:
    """Pack the documents like training does (text + EOS, concatenated, cut into blocks) and
    score them with plain transformers: the mean loss over equal blocks is token-weighted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = []
    for line in Path(jsonl).read_text().splitlines():
        ids += tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(ids) // SEQ
    blocks = torch.tensor(ids[:n * SEQ]).view(n, SEQ)
    with torch.no_grad():
        out = model(input_ids=blocks, labels=blocks)
    acc = (out.logits[:, :-1].argmax(-1) == blocks[:, 1:]).double().mean().item()
    return {"eval_loss": out.loss.item(), "eval_ppl": math.exp(out.loss.item()), "eval_acc": acc, "sequences": n}


def run_eval(*argv: str) -> dict:
    from shardtune.cli.eval import request
    from shardtune.evaluation.evaluate import run_eval as run

    return run(request(build_parser().parse_args(["eval", *argv])))


def test_the_cli_builds_the_typed_requests_with_the_library_defaults():
    """eval, generate and plan hand the library a dataclass, never the argparse Namespace; a flag's
    default and the field's default agree, so a library caller gets what the CLI gets."""
    from shardtune.cli import eval as eval_cli
    from shardtune.cli import generate as generate_cli
    from shardtune.cli.plan import plan_request
    from shardtune.evaluation.evaluate import EvalRequest, GenerateRequest
    from shardtune.plan.report import PlanRequest

    parser = build_parser()
    assert eval_cli.request(parser.parse_args(["eval", "m"])) == EvalRequest("m")
    assert generate_cli.request(parser.parse_args(["generate", "m"])) == GenerateRequest("m")
    assert generate_cli.request(parser.parse_args(["generate", "m", "--prompt", "a", "--prompt", "b"])).prompts == \
        ["a", "b"]
    assert plan_request(parser.parse_args(["plan", "--gpus", "2"])) == PlanRequest(2)


def assert_metrics(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert got["sequences"] == want["sequences"]
    assert abs(got["eval_loss"] - want["eval_loss"]) <= tol, (got, want)
    assert abs(got["eval_ppl"] - want["eval_ppl"]) <= tol * want["eval_ppl"], (got, want)
    assert abs(got["eval_acc"] - want["eval_acc"]) <= 1e-9, (got, want)


# ----------------------------------------------------------------------------- export


def test_export_round_trip(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    code, err = cli(["export", str(trained), str(out), "--max-shard-size", "100KB"], capsys)
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # split above the size limit
    assert torch.equal(logits(out), logits(trained / "final"))  # the checkpoint = the in-memory weights

    from transformers import AutoTokenizer

    text = "def f(x):\n    return x"
    exported, final = (AutoTokenizer.from_pretrained(folder) for folder in (out, trained / "final"))
    assert exported(text).input_ids == final(text).input_ids

    one_line_error(*cli(["export", str(trained), str(out)], capsys), "not empty")
    hub = tmp_path / "hub"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored token either
    one_line_error(*cli(["export", str(trained / "checkpoints" / "step-000006"), str(hub),
                         "--push-to-hub", "nobody/shardtune-test"], capsys), "needs a Hub token", "HF_TOKEN")
    assert not hub.exists()  # refused before the export, not after it
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")  # the upload itself fails (no network, or 401)
    one_line_error(*cli(["export", str(trained / "checkpoints" / "step-000006"), str(hub),
                         "--push-to-hub", "nobody/shardtune-test"], capsys), "could not push", str(hub))
    assert (hub / "config.json").is_file()  # the export itself is kept


@pytest.mark.parametrize("limit", ["100KiB", "0.1MiB", "102400B"])
def test_export_takes_every_size_the_option_accepts(trained, tmp_path, capsys, limit):
    """`--max-shard-size 16GiB` (the option's own grammar) reached huggingface_hub as text, whose
    grammar has no GiB, MiB or B: a ValueError traceback. The library now gets bytes."""
    code, err = cli(["export", str(trained), str(tmp_path / "hf"), "--max-shard-size", limit], capsys)
    assert code == 0, err
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1  # split above 100 KiB


# ----------------------------------------------------------------------------- eval


def test_eval_equals_hand_computation(trained, ck_assets):  # noqa: F811
    want = hand_metrics(trained / "final", ck_assets["validation"])
    final = run_eval(str(trained / "final"), "--data", ck_assets["validation"], "--seq-len", str(SEQ))
    assert_metrics(final["model"], want)
    # A checkpoint, with no --data: the validation split of its run, which is the same file.
    assert_metrics(run_eval(str(trained / "checkpoints" / "step-000006"))["model"], want)


def test_eval_compare_side_by_side(trained, capsys):
    base = trained.parent / "base-model"
    results = run_eval(str(trained / "checkpoints"), "--compare", str(base), "--max-batches", "2")
    assert results["base"]["eval_loss"] > results["model"]["eval_loss"]  # training helped
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "fine-tuned" in line)
    assert header.split() == ["base", "fine-tuned"]
    assert re.search(r"^perplexity\s+[\d.]+\s+[\d.]+$", table, re.M), table
    assert main(["eval", str(trained / "checkpoints"), "--compare", str(base), "--max-batches", "2"]) == 0
    assert capsys.readouterr().out.strip() == table.strip()  # the CLI prints the same table


@pytest.mark.multiproc
def test_eval_two_ranks_equals_one(trained, ck_assets):  # noqa: F811
    want = hand_metrics(trained / "final", ck_assets["validation"])
    proc = spawn(["-m", "shardtune", "eval", str(trained / "final"), "--data", ck_assets["validation"],
                  "--seq-len", str(SEQ), "--micro-batch-size", "3", "--nproc", "2", "--device", "cpu"])
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    rows = {line.split()[0]: line.split()[1] for line in output.splitlines()
            if line.split() and line.split()[0] in ("loss", "perplexity", "accuracy", "sequences")}
    assert int(rows["sequences"]) == want["sequences"]  # uneven split over ranks: padding rows are masked
    assert abs(float(rows["loss"]) - want["eval_loss"]) <= 1e-4  # printed with 4 decimals
    assert abs(float(rows["accuracy"]) - want["eval_acc"]) <= 1e-4


def test_anything_of_a_run_evaluates_on_the_runs_data(trained, ck_assets):  # noqa: F811
    """One rule wherever a model is asked for: the run folder, its final/, checkpoints/, a
    checkpoint or the `latest` pointer all bring the run's data (no --data needed)."""
    want = hand_metrics(trained / "final", ck_assets["validation"])
    for spec in (trained, trained / "final", trained / "checkpoints" / "latest"):
        assert_metrics(run_eval(str(spec))["model"], want)


@pytest.fixture(scope="module")
def alpaca_split(tmp_path_factory) -> Path:
    """Instruct rows with the alpaca columns: train.jsonl and validation.jsonl."""
    folder = tmp_path_factory.mktemp("alpaca-split")
    rows = [{"instruction": f"Add one to {i}.", "input": "" if i % 3 else f"the number {i}",
             "output": f"It is {i + 1}."} for i in range(22)]
    for name, part in (("train", rows[:16]), ("validation", rows[16:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder


ALPACA_LAYOUT = "alpaca"  # hand_response_loss: the default prompt layout, else a data.template


def hand_response_loss(folder: Path, jsonl: Path, template: str = ALPACA_LAYOUT, cutoff: int = 128) -> float:
    """Token-weighted loss over the responses alone (prompt, then response + EOS, cut at `cutoff`;
    the prompt gets no loss, an example with no response token left is skipped), with plain
    transformers, one example at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.data.formats import PROMPT_NO_INPUT, PROMPT_WITH_INPUT

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    total = count = 0
    for row in map(json.loads, jsonl.read_text().splitlines()):
        layout = template if template != ALPACA_LAYOUT else PROMPT_WITH_INPUT if row["input"] else PROMPT_NO_INPUT
        p = tok(layout.format(**row), add_special_tokens=False)["input_ids"]
        a = (tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:cutoff - len(p)]
        if a:
            with torch.no_grad():
                loss = model(input_ids=torch.tensor([p + a]), labels=torch.tensor([[-100] * len(p) + a])).loss
            total, count = total + loss.item() * len(a), count + len(a)
    return total / count


INSTRUCT_TEMPLATE = "Q: {instruction} {input}\nA:"


@pytest.fixture(scope="module")
def instruct_run(ck_assets, alpaca_split, tmp_path_factory):  # noqa: F811
    """A 1-step instruct run on `alpaca_split` with a prompt template of its own."""
    from shardtune.train.trainer import run

    out = tmp_path_factory.mktemp("instruct") / "run"
    run(config(ck_assets, out, **{"data.path": str(alpaca_split), "data.format": "instruct", "data.end_idx": "null",
                                  "data.template": json.dumps(INSTRUCT_TEMPLATE), "train.max_steps": 1}))
    release_group()
    return out


def test_eval_reads_data_in_the_runs_format(trained, instruct_run, alpaca_split):
    """An instruct run scores --data as it trained (its template; the responses alone, not packed
    text); --format chooses otherwise, and a plain model folder takes --format instruct alike."""
    out, rows = instruct_run, alpaca_split / "validation.jsonl"
    want = hand_response_loss(out / "final", rows, INSTRUCT_TEMPLATE, cutoff=64)
    own = run_eval(str(out))["model"]  # the run's validation split
    given = run_eval(str(out), "--data", str(alpaca_split))["model"]  # the same rows through --data
    assert own["sequences"] == given["sequences"] == 6
    assert abs(own["eval_loss"] - want) <= 1e-5 and abs(given["eval_loss"] - want) <= 1e-5, (own, given, want)
    text = run_eval(str(out), "--data", str(alpaca_split), "--format", "text", "--text-field", "output",
                    "--seq-len", "8")["model"]
    assert abs(text["eval_loss"] - want) > 1e-3  # packed blocks of the responses alone
    base = trained.parent / "base-model"  # no run: text unless --format says otherwise
    got = run_eval(str(base), "--data", str(alpaca_split), "--format", "instruct")["model"]
    assert got["sequences"] == 4  # the two rows with an input have no response token left within 128 positions
    assert abs(got["eval_loss"] - hand_response_loss(base, rows)) <= 1e-5


def test_a_refusal_of_the_runs_own_data_at_evals_seq_len_names_the_option(instruct_run, capsys):
    """--seq-len on the run's own data: the refusal names --seq-len (eval has no data.seq_len)."""
    code, err = cli(["eval", str(instruct_run), "--seq-len", "4"], capsys)
    one_line_error(code, err, "within --seq-len=4; raise --seq-len")


def test_generate_lays_prompts_out_as_the_run_trained(instruct_run, capsys):
    """A prompt to an instruct run is its instruction in the run's template (greedy text equal to
    plain transformers' on that layout); --format text sends it as given."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(instruct_run / "final")
    model = AutoModelForCausalLM.from_pretrained(instruct_run / "final").eval()
    question = "Add one to 3."
    laid_out = INSTRUCT_TEMPLATE.format(instruction=question, input="")
    for argv, given in (([], laid_out), (["--format", "text"], question)):
        ids = tok(given, add_special_tokens=False)["input_ids"]
        new = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
        code = main(["generate", str(instruct_run), "--prompt", question, "--temperature", "0", "--max-new-tokens",
                     "4", "--device", "cpu", *argv])
        out = capsys.readouterr()
        assert code == 0 and out.out == given + tok.decode(new[0, len(ids):], skip_special_tokens=True) + "\n"
        assert ("--format text sends them as given" in out.err) == (not argv), out.err


def test_eval_bad_input(trained, tmp_path, capsys):
    one_line_error(*cli(["eval", str(trained.parent / "base-model")], capsys), "--data")  # no run: no data
    one_line_error(*cli(["eval", str(tmp_path / "nothing-here")], capsys), "not found")
    (tmp_path / "empty").mkdir()
    one_line_error(*cli(["eval", str(tmp_path / "empty")], capsys), "neither a model folder")


# ----------------------------------------------------------------------------- generate


def test_generate_matches_transformers(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.checkpoint.loading import load_model
    from shardtune.evaluation.evaluate import generate

    prompt = "Return the"
    tok = AutoTokenizer.from_pretrained(trained / "final")
    model = AutoModelForCausalLM.from_pretrained(trained / "final").eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    want = tok.decode(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                     pad_token_id=tok.eos_token_id)[0, ids.shape[1]:], skip_special_tokens=True)
    ckpt_model, ckpt_tok, _, _ = load_model(str(trained / "checkpoints" / "step-000006"))
    assert generate(ckpt_model, ckpt_tok, [prompt], max_new_tokens=8, temperature=0) == [want]

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Return the\n\nThe value\n")
    capsys.readouterr()
    assert main(["generate", str(trained), "--prompts-file", str(prompts), "--max-new-tokens", "8",
                 "--temperature", "0", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"=== prompt 1 ===\n{prompt}{want}\n" in printed and "=== prompt 2 ===\nThe value" in printed
    sampled = [generate(model, tok, ["The value"], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # the seed makes sampling reproducible


def test_a_temperature_too_small_to_sample_decodes_greedily(trained, capsys):
    """The logits divided by 1e-300 overflowed to inf and sampling raised a traceback; sampling that
    cold picks the likeliest token anyway, so it is the greedy text (`generate` and `eval --generate`)."""
    def text(temperature: str) -> str:
        assert main(["generate", str(trained / "final"), "--prompt", "Return the", "--max-new-tokens", "4",
                     "--temperature", temperature, "--device", "cpu"]) == 0
        return capsys.readouterr().out

    greedy = text("0")
    assert [text(t) for t in ("1e-300", "5e-324", "1e-6")] == [greedy] * 3


def test_generate_prints_and_bad_input(trained, capsys, tmp_path):
    code = main(["generate", str(trained / "final"), "--prompt", "Return the", "--prompt", "The",
                 "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "=== prompt 2 ===" in out and "Return the" in out
    one_line_error(*cli(["generate", str(trained / "final")], capsys), "--prompt")
    one_line_error(*cli(["generate", str(trained / "final"), "--prompt", "x", "--top-p", "0"], capsys), "--top-p")
    one_line_error(*cli(["generate", str(trained / "final"), "--prompt", "x", "--max-new-tokens", "100000"], capsys),
                   "--max-new-tokens 100000 leaves no room", "positions", "--max-new-tokens 127 or less")
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    one_line_error(*cli(["generate", str(trained / "final"), "--prompts-file", str(tmp_path / "latin1.txt")], capsys),
                   "not UTF-8")


@pytest.mark.parametrize("data, words, extra", [
    ('{"body": "a few words of text"}\n', ["has no column 'text', which --text-field names", "set --text-field"], []),
    (None, ["not found", "check --data"], []),
    ('{"prompt": "a", "output": "b"}\n', ["--format=instruct needs a column 'instruction'",
                                          "rename the file's columns"], ["--format", "instruct"]),
    ('{"messages": []}\n', ["--format chat lays examples out with the tokenizer's chat template",
                            "choose --format instruct or text"], ["--format", "chat"]),
    ('{"instruction": "a", "output": "b"}\n', ["keeps a response", "within --seq-len=2; raise --seq-len"],
     ["--format", "instruct", "--seq-len", "2"]),
    ('{"body": "a few words of text"}\n', ["has no column 'text', which --text-field names"], ["--generate", "2"]),
])
def test_a_refusal_of_datas_files_names_evals_options(trained, tmp_path, capsys, data, words, extra):
    """eval has no data.* keys: a refusal of --data's files names the option that sets each, and
    says what to do about a key eval has no option for."""
    path = tmp_path / "eval.jsonl"
    if data is not None:
        path.write_text(data * 40)
    code, err = cli(["eval", str(trained), "--data", str(path), *extra], capsys)
    one_line_error(code, err, *words)
    assert not re.search(r"data\.(text_field|path|format|seq_len|cutoff_len)", err), err


def test_report_says_whose_generation_scores_a_resumed_run_shows(trained, ck_assets, tmp_path, capsys):  # noqa: F811
    """generation.json kept the scores of the model `eval --generate` scored: after a resume trained
    the run further, `report` showed them as the run's. Now they are labelled with their step, the
    report says when that is not the run's last one and how to score it; an older file (no step) is
    read, with that said."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    generate = ["eval", str(run), "--generate", "2", "--prompt-tokens", "8", "--max-new-tokens", "2"]
    rerun = f"rerun `shardtune eval {run} --generate 2`"

    def report() -> tuple[str, str]:
        assert main(["report", str(run)]) == 0
        return (run / "report" / "report.md").read_text(), capsys.readouterr().out

    assert main(generate) == 0
    assert json.loads((run / "generation.json").read_text())["models"]["model"]["step"] == 6
    text, _ = report()
    assert "## Generation quality: run (model at step 6)" in text and rerun not in text
    assert main(["train", *overrides(ck_assets, run, resume="auto", **{"train.max_steps": 8,
                                                                        "checkpoint.every_steps": 6})]) == 0
    release_group()
    text, printed = report()
    assert "## Generation quality: run (model at step 6)" in text
    assert "scores of the model at step 6, not of the run's model now (step 8)" in text and rerun in text
    assert rerun in printed
    old = json.loads((run / "generation.json").read_text())
    del old["models"]["model"]["step"]
    (run / "generation.json").write_text(json.dumps(old))
    text, _ = report()
    assert "## Generation quality: run\n" in text and "does not record which step's model it scored" in text
    assert main(generate) == 0
    text, _ = report()
    assert "## Generation quality: run (model at step 8)" in text and rerun not in text
