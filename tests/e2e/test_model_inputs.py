"""Bad model inputs, with test_errors.py's harness: model configs, model folders and tokenizers,
names that are neither a folder nor a Hub id, checkpoints given to export, lengths against a
model's positions. Each is one `error: ...` line naming the problem and the fix, exit code 2, no
traceback, nothing already written destroyed (data files: test_input_errors.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_errors import (  # noqa: F401 - fixtures used by name (and the autouse isolation)
    TINY_GPT2,
    _isolated,
    datasets_cache,
    fails,
    out,
    qs_assets,
    recipe,
    snapshot,
    write_jsonl,
)
from test_outputs import earlier_run, tree  # noqa: F401 - a finished run with checkpoints

from shardtune.cli.main import main
from shardtune.names import hub_id

# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("config, words", [
    ({"model_type": "t5"}, ["no causal-LM head"]),
    ({**TINY_GPT2, "n_embd": 33}, ["cannot build", "divisible"]),
    ({**TINY_GPT2, "n_head": 0}, ["model.config.n_head=0", "no attention heads"]),
    ({**TINY_GPT2, "layer_norm_epsilon": float("nan")}, ["model.config.layer_norm_epsilon=nan"]),
    # builds, then failed at the first forward (shapes) or trained a model that sees the next token
    ({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 3,
      "intermediate_size": 64, "num_hidden_layers": 1}, ["2 attention heads", "3 key/value heads"]),
    ({"model_type": "bert", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
      "num_hidden_layers": 1}, ["is_decoder=false", "model.config.is_decoder=true"]),
    ({"model_type": "gemma3_text", "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 16, "intermediate_size": 64, "num_hidden_layers": 1, "use_bidirectional_attention": True},
     ["use_bidirectional_attention=true", "model.config.use_bidirectional_attention=false"]),  # EmbeddingGemma
])
def test_model_config_that_cannot_be_built(capfd, recipe, out, config, words):
    fails(capfd, ["train", recipe, f"model.config={yaml.safe_dump(config, default_flow_style=True).strip()}",
                  f"output_dir={out}"], *words)


# OPT with post-norm blocks has no final norm: outside its blocks only the embeddings (and the tied head)
OPT_POST_NORM = {"model_type": "opt", "num_hidden_layers": 1, "hidden_size": 32, "ffn_dim": 64,
                 "num_attention_heads": 2, "word_embed_proj_dim": 32, "max_position_embeddings": 64,
                 "do_layer_norm_before": False}


@pytest.mark.parametrize("command", ["train", "plan"])
def test_freezing_that_leaves_nothing_to_train_is_refused(capfd, recipe, out, command):
    """trainable_blocks=0 keeps the final norm training, but this model has none: the optimizer got
    an empty parameter list (a traceback), after the data was read."""
    config = f"model.config={yaml.safe_dump(OPT_POST_NORM, default_flow_style=True).strip()}"
    tail = [f"output_dir={out}"] if command == "train" else ["--gpus", "1", "--gpu-mem", "16GiB"]
    fails(capfd, [command, recipe, config, "freeze.trainable_blocks=0", *tail],
          "freeze.trainable_blocks=0 leaves this opt model no parameter to train", "freeze.trainable_blocks=1 or more")
    assert not (out / "metrics.jsonl").exists()


LLAMA = ("model.config={model_type: llama, num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64, "
         "num_attention_heads: 2, max_position_embeddings: 64, ")


@pytest.mark.parametrize("override, named, what", [
    ("model.config.attn_pdrop=1.5", "model.config.attn_pdrop=1.5", "dropout probability"),
    ("model.config.resid_pdrop=-0.1", "model.config.resid_pdrop=-0.1", "dropout probability"),
    (LLAMA + "attention_dropout: 2.0}", "model.config.attention_dropout=2.0", "dropout probability"),
    ("model.config={model_type: opt, num_hidden_layers: 1, hidden_size: 32, ffn_dim: 64, num_attention_heads: 2, "
     "word_embed_proj_dim: 32, max_position_embeddings: 64, dropout: 7}", "model.config.dropout=7",
     "dropout probability"),
    (LLAMA + "rope_theta: 0}", "rope_theta=0", "rotary base"),
    (LLAMA + "rms_norm_eps: -1.0}", "model.config.rms_norm_eps=-1.0", "norm's epsilon"),
    (LLAMA + "rope_scaling: {rope_type: linear, factor: -2.0}}", "factor=-2.0", "rotary scaling factor"),
    ("model.config.layer_norm_epsilon=-1e-5", "model.config.layer_norm_epsilon=-1e-05", "norm's epsilon"),
])
def test_a_config_value_out_of_its_range_is_refused(capfd, recipe, out, override, named, what):
    """The config built; torch refused a dropout probability in the middle of the first step (a
    traceback), or (GPT-2's nn.Dropout) when the model was built, blamed on the hidden size; a rotary
    base, scaling factor or epsilon out of range gave NaN at step 1."""
    fails(capfd, ["train", recipe, override, f"output_dir={out}"], named, f"{what} out of range", "set model.config.")
    assert not (out / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, qs_assets) -> Path:
    """A saved tiny GPT-2 (weights, config, tokenizer), as a user's model folder."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("model")
    config = dict(TINY_GPT2)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), vocab_size=300, **config)
                                     ).save_pretrained(folder)
    for file in Path(qs_assets["tokenizer"]).iterdir():
        shutil.copy(file, folder)
    return folder


@pytest.mark.parametrize("model, override, words", [
    ("config", "quantization_config=0", ["model.config.quantization_config=0", "cannot write to a config.json"]),
    ("config", "dtype=[1]", ["model.config.dtype=[1]", "cannot write to a config.json"]),
    ("folder", "use_return_dict=true", ["model.config.use_return_dict=True", "refused by transformers"]),
    ("folder", "num_labels=x", ["model.config.num_labels='x'", "refused by transformers"]),
])
def test_a_config_value_transformers_takes_but_cannot_use_is_refused(capfd, tmp_path, model_folder, model, override,
                                                                     words):
    """transformers took these, then its to_dict (every check, every save) or the field's setter
    raised: a traceback from every command (found by test_fuzz's test_model_config_values)."""
    source = f"model.name_or_path={model_folder}" if model == "folder" else f"model.config={json.dumps(TINY_GPT2)}"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"path": "x.jsonl"}}))
    fails(capfd, ["slurm", str(recipe), source, f"model.config.{override}", "--nodes", "1", "--gpus-per-node", "1"],
          *words)


@pytest.mark.parametrize("edit, words", [
    ({"n_embd": 64}, ["in model.safetensors has shape", "but the config makes it"]),
    ({"n_layer": 2}, ["lacks 12 weight(s)", "transformer.h.1.", "start random"]),  # loaded, with layer 1 random
    ({"tie_word_embeddings": False}, ["lm_head.weight", "start random"]),
    # a 7B Llama's config beside GPT-2's weights: the load was killed for memory
    ({"model_type": "llama"}, ["a model of 6,477,500,416 parameters but its weights hold 24,416"]),
])
def test_model_folder_whose_weights_do_not_fit_its_config(capfd, tmp_path, model_folder, edit, words):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    fails(capfd, ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"], str(folder), *words,
          "config.json")


# a size of 0 (or less) in a model folder's config.json: eval said "set fsdp.block_class" (an option
# it has not), generate answered from the embeddings alone, torch warned before the line
SIZE_EDITS = {"n_layer": (0, "no decoder blocks"), "num_hidden_layers": (0, "no decoder blocks"),
              "vocab_size": (0, "no vocabulary"), "n_embd": (0, "no hidden units"), "n_head": (0, "no attention heads"),
              "n_inner": (0, "weight transformer.h.0.mlp.c_fc.weight empty")}
SIZE_COMMANDS = {
    "generate": ["generate", "{model}", "--prompt", "hi", "--max-new-tokens", "2"],
    "eval": ["eval", "{model}", "--data", "{data}", "--seq-len", "32"],
    "train": ["train", "{recipe}", "model.config={{}}", "model.name_or_path={model}", "output_dir={out}"],
    "plan": ["plan", "{recipe}", "model.config={{}}", "model.name_or_path={model}", "--gpus", "1", "--gpu-mem",
             "16GiB"],
}


@pytest.mark.parametrize("command", SIZE_COMMANDS)
@pytest.mark.parametrize("field", SIZE_EDITS)
def test_a_size_of_zero_in_config_json_is_refused_by_every_command(capfd, recwarn, tmp_path, recipe, out, qs_assets,
                                                                    model_folder, field, command):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    value, words = SIZE_EDITS[field]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    argv = [a.format(model=folder, data=qs_assets["validation"], recipe=recipe, out=out)
            for a in SIZE_COMMANDS[command]]
    named = [] if field == "n_inner" else [f"{'n_layer' if field == 'num_hidden_layers' else field}={value} in "
                                           f"{str(folder / 'config.json')!r}"]
    line = fails(capfd, argv, words, *named)
    assert "fsdp.block_class" not in line and not (out / "metrics.jsonl").exists()
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("override, words", [
    ("model.config.n_layer=0", ["model.config.n_layer=0", "no decoder blocks", "model.config.n_layer to 1"]),
    ("model.config.vocab_size=0", ["model.config.vocab_size=0", "no vocabulary"]),
])
def test_a_size_of_zero_in_model_config_names_the_override(capfd, recwarn, recipe, out, override, words):
    fails(capfd, ["train", recipe, override, f"output_dir={out}"], *words)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("argv", [
    ["generate", "{big}", "--prompt", "zzqx hi", "--max-new-tokens", "2"],
    ["eval", "{big}", "--data", "{data}", "--seq-len", "32"],
    ["eval", "{model}", "--compare", "{big}", "--data", "{data}", "--seq-len", "32"],
    ["eval", "{big}", "--data", "{data}", "--generate", "1", "--max-new-tokens", "2"],
    ["train", "{recipe}", "model.config={{}}", "model.name_or_path={big}", "model.tokenizer={big}",
     "output_dir={out}"],
], ids=["generate", "eval", "eval-compare", "eval-generate", "train"])
def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(capfd, tmp_path, recipe, out, model_folder, argv):
    """eval and generate on a plain model folder skipped train's check: an IndexError deep in torch."""
    import shutil

    big = tmp_path / "big"
    shutil.copytree(model_folder, big)
    tokens = add_two_tokens(big, big)
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": "zzqx qqxz hello zzqx world " * 8}] * 40)
    fails(capfd, [a.format(big=big, model=model_folder, data=data, recipe=recipe, out=out) for a in argv],
          f"has {tokens} tokens but the model only 300")


def test_a_model_that_is_not_finite_from_the_start_is_not_blamed_on_the_learning_rate(capfd, recipe, out, tmp_path,
                                                                                     model_folder):
    """Step 1 computes on the starting weights (here one infinite weight): the line said 'lower
    train.lr', which cannot help."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    weights = load_file(folder / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("inf")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    argv = ["train", recipe, f"model.name_or_path={folder}", "model.config={}", f"model.tokenizer={folder}",
            f"output_dir={out}"]
    line = fails(capfd, argv, "at step 1", "not train.lr", "check the model's config and weights")
    assert "lower train.lr" not in line


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_dropout_probability_outside_0_1_in_config_json_is_refused(capfd, tmp_path, qs_assets, model_folder, command):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_pdrop": 1.5}))
    argv = [a.format(model=folder, data=qs_assets["validation"], recipe="", out="") for a in SIZE_COMMANDS[command]]
    fails(capfd, argv, f"attn_pdrop=1.5 in {str(folder / 'config.json')!r}", "dropout probability out of range")


def test_model_folder_with_a_generation_config_transformers_refuses(capfd, tmp_path, model_folder):
    """Its values were checked only once the weights had loaded, and blamed on the weights."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": -5}))
    fails(capfd, ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"],
          "generation_config.json", "max_new_tokens", "fix or remove it")


def test_model_path_that_is_a_file(capfd, recipe, out, tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    fails(capfd, ["train", recipe, f"model.name_or_path={tmp_path / 'model.bin'}", f"output_dir={out}"],
          "is a file, not a folder")


def test_seq_len_above_model_maximum(capfd, recipe, out):
    before = snapshot(out)
    fails(capfd, ["train", recipe, "data.seq_len=128", f"output_dir={out}"],
          "data.seq_len=128", "maximum of 64", "data.seq_len=64 or less")
    assert snapshot(out) == before


def test_missing_tokenizer(capfd, recipe, out, tmp_path):
    fails(capfd, ["train", recipe, f"model.tokenizer={tmp_path / 'no-tokenizer'}", f"output_dir={out}"],
          "no-tokenizer", "not found")




# ----------------------------------------------------------------------------- paths that are not there


@pytest.mark.parametrize("missing", ["{tmp}/no-such/model", "./no-such-model", "../no-such-model", "a/b/c"])
@pytest.mark.parametrize("argv", [
    ["generate", "{path}", "--prompt", "hi"],
    ["eval", "{path}", "--data", "{data}"],
    ["eval", "{model}", "--compare", "{path}", "--data", "{data}", "--seq-len", "32"],
    ["train", "{recipe}", "model.config={{}}", "model.name_or_path={path}", "output_dir={out}"],
    ["train", "{recipe}", "model.tokenizer={path}", "output_dir={out}"],
], ids=["generate", "eval", "eval-compare", "model.name_or_path", "model.tokenizer"])
def test_a_path_that_is_not_there_is_not_a_hub_id(capfd, recipe, out, tmp_path, qs_assets, model_folder, missing,
                                                   argv):
    """A missing folder was looked up on the Hub: 'not found ... run `shardtune download /abs/path`'
    (or, for eval's MODEL, a missing *tokenizer*)."""
    path = missing.format(tmp=tmp_path)
    assert hub_id(path) is None and hub_id("gpt2") == "gpt2" and hub_id("org/model") == "org/model"
    line = fails(capfd, [a.format(path=path, data=qs_assets["validation"], model=model_folder, recipe=recipe,
                                  out=out) for a in argv], repr(path), "not found: no such folder")
    assert "download" not in line, line


@pytest.fixture
def folder_without_tokenizer(tmp_path, model_folder) -> Path:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*",
                                                                         "special_tokens*"))
    assert (folder / "config.json").is_file() and not list(folder.glob("tokenizer*"))
    return folder


@pytest.mark.parametrize("argv", [
    ["generate", "{model}", "--prompt", "hi", "--max-new-tokens", "2"],
    ["eval", "{model}", "--data", "{data}", "--seq-len", "32"],
    ["train", "{recipe}", "model.tokenizer={model}", "output_dir={out}"],
], ids=["generate", "eval", "train"])
def test_a_tokenizer_without_vocabulary_is_refused(capfd, recipe, out, qs_assets, folder_without_tokenizer, argv):
    """transformers loads a folder without tokenizer files as an empty tokenizer: generate answered
    from no prompt, eval said the data was shorter than one block, train trained on EOS tokens."""
    fails(capfd, [a.format(model=folder_without_tokenizer, data=qs_assets["validation"], recipe=recipe, out=out)
                  for a in argv], "has no vocabulary", "tokenizer files")
    assert not (out / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- checkpoints given to export


def _step(run: Path) -> Path:
    return run / "checkpoints" / "step-000002"


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("source, target, words", [
    (_step, lambda run: _step(run) / "hf", ["lies inside checkpoint"]),
    (_step, _step, ["lies inside checkpoint"]),
    (lambda run: run, lambda run: run / "checkpoints" / "hf", ["inside checkpoints/ of the run"]),
    (_step, lambda run: run / "final" / "hf", ["inside final/ of the run"]),
    (_step, lambda run: run / "metrics.jsonl", ["is a file"]),
    (_step, lambda run: _link(run.parent / "hf", run.parent / "gone" / "hf"), ["is a link to", "which does not exist"]),
    (lambda run: run / "final", lambda run: run.parent / "hf", ["a Hugging Face model folder", "use it as it is"]),
], ids=["inside-the-checkpoint", "the-checkpoint-itself", "inside-checkpoints", "inside-final", "a-file",
        "a-link-to-nothing", "final-is-no-checkpoint"])
def test_export_refuses_an_out_the_run_would_take_and_a_folder_that_is_no_checkpoint(capfd, earlier_run, tmp_path,
                                                                                      source, target, words):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(earlier_run, run, symlinks=True)
    before = tree(run)
    fails(capfd, ["export", str(source(run)), str(target(run))], *words)
    assert tree(run) == before and not (run.parent / "hf").exists()


def test_export_takes_the_latest_pointer_and_names_a_missing_tokenizer(capfd, earlier_run, tmp_path):
    """eval and generate took checkpoints/latest, export said it was an incomplete checkpoint; a
    checkpoint without its tokenizer/ was a tokenizer to download."""
    import shutil

    assert main(["export", str(earlier_run / "checkpoints" / "latest"), str(tmp_path / "hf")]) == 0
    capfd.readouterr()
    assert (tmp_path / "hf" / "config.json").is_file()
    step = tmp_path / "step"
    shutil.copytree(_step(earlier_run), step, ignore=shutil.ignore_patterns("tokenizer"))
    for argv in (["export", str(step), str(tmp_path / "out")], ["generate", str(step), "--prompt", "hi"]):
        fails(capfd, argv, "has no tokenizer/ folder", "another checkpoint")
    assert not (tmp_path / "out").exists()


def save_lora(base: Path, folder: Path) -> None:
    """A LoRA adapter of the model folder `base`, saved by peft into `folder`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["c_attn"])
                   ).save_pretrained(folder)


def add_two_tokens(folder: Path, source: Path) -> int:
    """`source`'s tokenizer with two tokens added, saved into `folder`; its length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(["zzqx", "qqxz"])
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


@pytest.fixture
def lora_run(tmp_path, model_folder) -> Path:
    """A run folder (its marks) whose final/ is a LoRA adapter of `model_folder`, as a peft run leaves it."""
    run = tmp_path / "lora-run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text("")
    save_lora(model_folder, run / "final")
    return run


ADAPTER_COMMANDS = pytest.mark.parametrize("argv", [
    ["generate", "{adapter}", "--prompt", "zzqx hi", "--max-new-tokens", "2"],
    ["eval", "{adapter}", "--data", "{data}", "--seq-len", "32"],
    ["eval", "{model}", "--compare", "{adapter}", "--data", "{data}", "--seq-len", "32"],
    ["eval", "{adapter}", "--data", "{data}", "--generate", "1", "--max-new-tokens", "2", "--out", "{out}/g.json"],
    ["export", "{adapter}", "{out}", "--merge"],
], ids=["generate", "eval", "eval-compare", "eval-generate", "export-merge"])


@ADAPTER_COMMANDS
def test_an_adapter_saved_without_a_tokenizer_takes_its_bases(capfd, tmp_path, model_folder, argv):
    """A peft adapter saved elsewhere usually has no tokenizer files: every command that opens it
    uses its base's (they refused it as a damaged tokenizer folder)."""
    adapter = tmp_path / "adapter"
    save_lora(model_folder, adapter)
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": "hello world " * 8}] * 40)
    out = tmp_path / "out"
    assert main([a.format(adapter=adapter, model=model_folder, data=data, out=out) for a in argv]) == 0, \
        capfd.readouterr().err
    if argv[0] == "export":
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(model_folder).get_vocab()


@pytest.mark.parametrize("command", ["train", "plan"])
def test_an_adapter_folder_given_as_the_model_to_train_is_refused(capfd, tmp_path, recipe, out, model_folder, command):
    """train and plan read model.name_or_path as a model: an adapter folder there was refused as a
    damaged tokenizer folder; now the line says what it is, and the two ways on."""
    adapter = tmp_path / "adapter"
    save_lora(model_folder, adapter)
    argv = [a.format(recipe=recipe, model=adapter, out=out) for a in SIZE_COMMANDS[command]]
    fails(capfd, argv, f"model.name_or_path={str(adapter)!r} is a peft adapter folder", f"on {str(model_folder)!r}",
          "--merge")
    if command == "train":  # as the tokenizer: a folder with no tokenizer, not a damaged one
        argv = [a.format(recipe=recipe, model=model_folder, out=out) for a in SIZE_COMMANDS[command]]
        fails(capfd, [*argv, f"model.tokenizer={adapter}"], f"folder {str(adapter)!r} holds no tokenizer")


@ADAPTER_COMMANDS
def test_an_adapters_tokenizer_larger_than_its_bases_vocabulary_is_refused(capfd, tmp_path, model_folder, argv):
    """An adapter folder whose tokenizer has tokens its base has no embedding for: eval and generate
    failed inside torch (IndexError), export --merge wrote a folder that every command refuses."""
    adapter = tmp_path / "adapter"
    save_lora(model_folder, adapter)
    tokens = add_two_tokens(adapter, model_folder)
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": "zzqx qqxz hello zzqx world " * 8}] * 40)
    out = tmp_path / "out"
    fails(capfd, [a.format(adapter=adapter, model=model_folder, data=data, out=out) for a in argv],
          f"the tokenizer in {str(adapter)!r} has {tokens} tokens but the adapter's base model", "only 300")
    assert not out.exists()


@pytest.mark.parametrize("argv", [["generate", "{step}", "--prompt", "zzqx hi", "--max-new-tokens", "2"],
                                  ["export", "{step}", "{out}"]], ids=["generate", "export"])
def test_a_checkpoints_tokenizer_larger_than_its_model_is_refused(capfd, earlier_run, tmp_path, argv):
    """A checkpoint whose tokenizer/ was replaced: generate failed inside torch, export wrote it."""
    import shutil

    step = tmp_path / "step"
    shutil.copytree(_step(earlier_run), step)
    tokens = add_two_tokens(step / "tokenizer", step / "tokenizer")
    fails(capfd, [a.format(step=step, out=tmp_path / "out") for a in argv],
          f"the tokenizer/ of checkpoint {str(step)!r} has {tokens} tokens but its model only 300")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["export", "{adapter}", "{out}"], ["train", "{recipe}", "peft.method=lora",
                                                                     "resume={adapter}", "output_dir={out}"]],
                         ids=["export", "resume"])
def test_an_adapter_folder_given_as_a_checkpoint_is_named(capfd, lora_run, tmp_path, recipe, argv):
    """A peft run's final/ to export without --merge (or to resume from) was 'not a complete
    checkpoint: an interrupted save?'."""
    adapter, out = lora_run / "final", tmp_path / "out"
    before = tree(lora_run)
    fails(capfd, [a.format(adapter=adapter, out=out, recipe=recipe) for a in argv],
          f"{str(adapter)!r} is a peft adapter folder", f"shardtune export {adapter} OUT --merge")
    assert tree(lora_run) == before and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("source, target, words", [
    (lambda run: run / "final", lambda run: run / "final" / "hf", ["lies inside adapter folder"]),
    (lambda run: run / "final", lambda run: run / "final", ["lies inside adapter folder"]),
    (lambda run: run, lambda run: run / "checkpoints" / "hf", ["inside checkpoints/ of the run"]),
    (lambda run: run / "final", lambda run: run / "metrics.jsonl", ["is a file"]),
    (lambda run: run / "final", lambda run: run, ["is not empty"]),
], ids=["inside-the-adapter", "the-adapter-itself", "inside-checkpoints", "a-file", "not-empty"])
def test_export_merge_refuses_the_outs_export_refuses(capfd, lora_run, source, target, words):
    """--merge skipped check_export's output-folder checks: it wrote into final/ (which the run's
    --overwrite replaces) and loaded the whole model before finding OUT was a file."""
    before = tree(lora_run)
    fails(capfd, ["export", str(source(lora_run)), str(target(lora_run)), "--merge"], *words)
    assert tree(lora_run) == before


# ----------------------------------------------------------------------------- lengths against a model's positions


@pytest.mark.parametrize("argv, words", [
    (["eval", "{model}", "--data", "{data}", "--seq-len", "100"], ["--seq-len 100", "--seq-len 64 or less"]),
    (["eval", "{model}", "--data", "{data}", "--generate", "1", "--max-new-tokens", "64"],
     ["--max-new-tokens 64", "--max-new-tokens 63 or less"]),
    (["eval", "{model}", "--data", "{data}", "--generate", "1", "--prompt-tokens", "64"],
     ["--prompt-tokens 64", "--prompt-tokens 63 or less"]),
    (["eval", "{model}", "--data", "{data}", "--generate", "1", "--prompt-tokens", "40", "--max-new-tokens", "30"],
     ["--prompt-tokens 40 plus --max-new-tokens 30", "64 or less"]),
    (["generate", "{model}", "--prompt", "hi", "--max-new-tokens", "100"], ["--max-new-tokens 63 or less"]),
], ids=["eval-seq-len", "eval-generate-new", "eval-generate-prompt", "eval-generate-both", "generate"])
def test_a_length_beyond_the_models_positions_names_its_option(capfd, qs_assets, model_folder, argv, words):
    """eval's refusal named data.seq_len, an option eval does not have."""
    line = fails(capfd, [a.format(model=model_folder, data=qs_assets["validation"]) for a in argv], *words,
                 "64 positions")
    assert "data.seq_len" not in line


@pytest.mark.parametrize("argv, cut", [
    (["eval", "{model}", "--data", "{data}", "--max-batches", "1"], "--seq-len 64"),
    (["eval", "{model}", "--data", "{data}", "--generate", "1"], "--max-new-tokens 32 (default 64)"),
    (["eval", "{model}", "--data", "{data}", "--generate", "1", "--prompt-tokens", "60"],
     "--max-new-tokens 4 (default 64)"),
    (["generate", "{model}", "--prompt", "hi"], "--max-new-tokens 62"),
], ids=["eval", "eval-generate", "eval-generate-long-prompt", "generate"])
def test_defaults_fit_a_model_with_few_positions_and_say_so(capfd, qs_assets, model_folder, argv, cut):
    """512 and 64 are defaults for models with room for them: on a 64-position model they failed."""
    assert main([a.format(model=model_folder, data=qs_assets["validation"]) for a in argv]) == 0
    captured = capfd.readouterr()
    assert f"note: {cut}:" in (captured.err if argv[0] == "generate" else captured.out)
