"""Recipes and overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import readme_renderer
from shardtune.config.load import load_config, parse_override
from shardtune.config.schema import reference_lines
from shardtune.errors import UserError

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_loads(recipe):
    cfg = load_config(recipe)
    assert cfg.recipe == recipe.stem
    assert cfg.model.name_or_path or cfg.model.config


def test_overrides_are_dotted_and_typed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: m}\ndata: {path: d}\ntrain: {lr: 0.1}\n")
    cfg = load_config(recipe, ["train.lr=3e-5", "fsdp.sharding=hybrid_shard", "train.betas=[0.9,0.99]",
                               "model.config.n_layer=4", "data.end_idx=100", "compile=true"])
    assert cfg.train.lr == 3e-5 and cfg.fsdp.sharding == "hybrid_shard"
    assert cfg.train.betas == [0.9, 0.99] and cfg.model.config == {"n_layer": 4}
    assert cfg.data.end_idx == 100 and cfg.compile is True
    assert cfg.model.name_or_path == "m"  # untouched keys keep the recipe's values


def test_a_float_with_an_exponent_is_a_float_in_a_free_mapping(tmp_path):
    """model.config is a free mapping (no typed field to coerce into): 1e-06 and 1.5e3, as JSON
    and Python write floats, stay floats (YAML 1.1 reads them as text, which transformers refuses)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: m, config: {layer_norm_epsilon: 1e-05}}\ndata: {path: d}\n")
    cfg = load_config(recipe, ['model.config={"rms_norm_eps": 1e-06, "rope_theta": 1.5e3, "n_layer": 2}'])
    assert cfg.model.config == {"rms_norm_eps": 1e-06, "rope_theta": 1500.0, "n_layer": 2}
    assert load_config(recipe, []).model.config == {"layer_norm_epsilon": 1e-05}


def test_parse_override_needs_key_and_value():
    assert parse_override("a.b=") == ("a.b", None)
    with pytest.raises(UserError):
        parse_override("nokey")


def test_reference_lists_every_key_with_its_comment():
    text = "\n".join(reference_lines())
    for key in ("fsdp.sharding", "fsdp.min_num_params", "train.global_batch_size", "data.start_idx",
                "eval.every_steps", "log.every_steps", "precision", "output_dir"):
        assert f"  {key} (" in text, key
    assert "hub id or local folder" in text  # the field's own comment travels into --help


def test_text_keys_take_override_text_that_yaml_would_read_as_a_mapping(tmp_path):
    cfg = load_config(None, ["model.config={model_type: gpt2}", "data.path=x",
                             "data.template=Quote: {quote} by {author}", "model.config.n_layer=3"])
    assert cfg.data.template == "Quote: {quote} by {author}"
    assert cfg.model.config == {"model_type": "gpt2", "n_layer": 3}


def test_readme_config_reference_is_the_schemas():
    """Every key with its type, default and comment: the README's block is what the schema renders."""
    render = readme_renderer()
    readme = render.README.read_text()
    stale = [line for line in render.config_block().splitlines() if line not in readme.splitlines()]
    assert not stale, f"README's config reference is stale (run tools/render_readme_reference.py): {stale[:3]}"


@pytest.mark.parametrize("override, key", [
    ("eval.every_steps=-1", "eval.every_steps"), ("fsdp.forward_prefetch=-2", "fsdp.forward_prefetch"),
    ("train.max_grad_norm=-1", "train.max_grad_norm"), ("log.peak_tflops=0", "log.peak_tflops"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last"), ("data.val_size=-0.1", "data.val_size"),
    ("loss_chunk_tokens=-5", "loss_chunk_tokens"), ("train.global_batch_size=1099511627777", "train.global_batch_size"),
])
def test_out_of_range_numbers_are_refused_with_the_key(override, key):
    with pytest.raises(UserError, match=key):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", override])


def test_auto_micro_batches_are_the_divisors_of_the_batch_per_rank():
    """micro_batch_size=auto's candidates: counted up to the batch per rank, a global batch of 1e9
    took minutes before train, plan, sweep or slurm said a word (2**40, the largest taken: hours)."""
    from shardtune.config.load import auto_micro_batches

    for n in range(1, 400):
        assert auto_micro_batches(n * 4, 4) == [m for m in range(1, n + 1) if n % m == 0]
    assert auto_micro_batches(2 ** 40, 1) == [2 ** k for k in range(41)]
    with pytest.raises(UserError, match="do not divide"):
        auto_micro_batches(6, 4)


@pytest.mark.parametrize("override, needle", [
    ("train.lr=.nan", "train.lr=nan is not a finite number"), ("train.lr=.inf", "train.lr=inf"),
    ("train.betas=[0.9,.nan]", "train.betas=nan"), ("train.epochs=-.inf", "train.epochs=-inf"),
    ("train.betas=[0.9,1.0]", "train.betas=1.0 must be below 1"),
    ("train.betas=[-0.1,0.9]", "train.betas=-0.1 must be at least 0"),
    ("train.eps=-1e-8", "train.eps=-1e-08 must be above 0"),
    ("train.eps=0", "train.eps=0.0 must be above 0"),  # 0/0 for weights without a gradient yet: NaN at step 1
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio=1.5"), ("train.max_steps=-3", "train.max_steps"),
    ("data.seq_len=1", "data.seq_len=1 must be at least 2"),  # nothing to predict: loss 0, perplexity 1
    ("peft.dropout=1.0", "peft.dropout"),
    ("log.peak_tflops=.inf", "log.peak_tflops=inf"),
    ("data.val_size=1.5", "data.val_size=1.5 is neither a fraction"),  # held out one document, not 1.5 %
    ("data.val_split=train", "data.val_split=train is the split it trains on"),  # validated on its training data
])
def test_values_the_libraries_would_reject_or_that_mean_nothing_are_refused(override, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", "peft.method=lora", override])


@pytest.mark.parametrize("overrides, needle", [
    (["peft.method=lora", "peft.r=0"], "peft.r=0 must be at least 1"),
    (["peft.method=lora", "peft.alpha=0"], "peft.alpha=0 must be at least 1"),
    (["peft.quantize=4bit"], "peft.quantize is a setting of peft.method=lora/dora, not of peft.method=none"),
    (["peft.method=lora", "peft.num_virtual_tokens=20"],
     "peft.num_virtual_tokens is a setting of peft.method=prefix_tuning/prompt_tuning, not of peft.method=lora"),
    (["peft.method=prompt_tuning", "peft.num_virtual_tokens=0"], "peft.num_virtual_tokens=0 must be at least 1"),
    (["peft.method=adaption_prompt", "peft.adapter_len=0"], "peft.adapter_len=0 must be at least 1"),
    (["peft.method=lora", "peft.lora_plus_ratio=-2"], "peft.lora_plus_ratio=-2.0 must be at least 0"),
    (["peft.method=prefix_tuning", "data.format=instruct", "data.packing=true"], "would hide from every document"),
    (["peft.method=prompt_tuning", "data.format=chat", "data.padding_free=true"], "data.document_mask=false"),
    (["peft.method=lora", "peft.quantize=4bit", "device=cuda"], "quantizes pretrained weights"),
    (["peft.method=lora", "peft.quantize=4bit", "model.name_or_path=m", "device=cpu"], "needs a CUDA GPU"),
    (["freeze.head_only=true", "freeze.trainable_blocks=1"], "exclude each other"),
    (["peft.method=lora", "freeze.embeddings=true"], "does not combine"),
    (["data.format=chat", "data.cutoff_len=1"], "data.cutoff_len=1 must be at least 2"),
    (["data.template=Q: {0}"], "positional field"),
    (["data.template=Q: {q"], "not a valid template"),
    (["data.template={q:>{width}}"], "takes the format spec of {q} from a field (>{width}); write the spec out"),
    (["data.template={q.__class__.__init__}"], "reads a Python attribute in {q.__class__.__init__}, not data"),
    (["data.format=instruct", "data.template=Q: {instruction}\nA: {output}"],
     "names the response column {output} (data.output_field); drop it from the template"),
])
def test_adapter_and_format_checks_need_only_the_config(overrides, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", *overrides])


def test_a_config_error_is_reported_before_any_data_is_read(tmp_path, capsys):
    """peft.r=0 with a dataset that does not exist: the config's error, not the data's, and at once."""
    from shardtune.cli.main import main

    code = main(["train", "model.config={model_type: gpt2}", f"data.path={tmp_path / 'missing.jsonl'}",
                 "peft.method=lora", "peft.r=0", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "peft.r=0 must be at least 1" in err and "missing" not in err, err
    assert not (tmp_path / "out").exists()


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefg", "bcdefgh", strict=True))


@pytest.mark.parametrize("text, needle", [
    ("train:\n  lr: 1\n  lr: 2\n", "key 'lr' is given twice (lines 4 and 5)"),
    ("train: {lr: 1}\ntrain: {seed: 2}\n", "key 'train' is given twice"),
    ("train:\n  lr: [1\n", "not valid YAML (line 5, column 1"),
    (BOMB, "expands to more than 100000 values"),
    ("train: &t {lr: *t}\n", "refers to a value that contains it"),
    ("train: {seed: " + "9" * 5000 + "}\n", "holds a value YAML cannot read (line 3, column 15: the int value"),
    # an explicit tag on text that is no such value: PyYAML raised a bare KeyError/AttributeError (a traceback)
    ("train: {seed: !!bool 2}\n", "holds a value YAML cannot read (line 3, column 15: the bool value '2'"),
    ("log: {run_name: !!timestamp x}\n", "line 3, column 17: the timestamp value 'x'"),
    ("train: {betas: [!!float x, 0.9]}\n", "line 3, column 17: the float value 'x'"),
    ("train: {seed: 18446744073709551616}\n", "train.seed=18446744073709551616 must be at most 2**63-1"),
    ("data: {template: '{x:10000000000}'}\n", "width above 10000"),
    ("1: 2\n", "config key 1 is not a name"),
    ("train.lr: 1\n", "unknown config key 'train.lr'; a recipe nests keys: write train: then lr:"),
    ("model.config.n_layer: 1\n", "write model: then config.n_layer: indented"),
    ("train: {max.steps: 1}\n", "unknown config key 'train.max.steps'; did you mean train.max_steps?"),
])
def test_recipes_are_read_strictly(tmp_path, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {config: {model_type: gpt2}}\n" + ("data: {path: d}\n" if "data:" not in text else "")
                      + text.replace("data: {", "data: {path: d, "))
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(recipe)


@pytest.mark.parametrize("override, needle", [
    ("data.path=", "no dataset given"), ("model.tokenizer=' '", "model.tokenizer is empty"),
    ("train.seed=-1", "train.seed=-1 must be at least 0"), ("train.lr=1" + "0" * 400, "too large to use"),
    ("train.max_steps=1.0e+300", "a number of about 300 digits must be at most 2**63-1"),
    ("peft.target_modules=[]", "peft.target_modules=[] is empty"),
    ("model.config={model_type: gpt2, n_embd: .inf}", "model.config.n_embd=inf is not a finite number"),
    ("data.num_proc=0", "data.num_proc=0 must be at least 1"),
    ("output_dir=a\x00b", "output_dir contains a NUL character"),
    ("train.seed=!!bool 2", "the value of train.seed holds a value YAML cannot read (line 1, column 1: the bool"),
])
def test_every_value_is_checked_by_its_type(override, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", override])


@pytest.mark.parametrize("text", ["model:\n  config:\n", "model:\n  config: null\n", "model: {config: ~}\n"])
def test_a_free_form_mapping_left_empty_is_empty(tmp_path, text):
    """YAML reads `config:` with nothing below it as null: no entries, as `config: {}` (it was
    refused as 'must be a mapping, got None')."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text + "data: {path: d}\n")
    assert load_config(recipe, ["model.name_or_path=gpt2"]).model.config == {}


@pytest.mark.parametrize("override, needle", [
    ("log.trackers=[tensorboard,mlflow,tensorboard]", "log.trackers lists tensorboard twice; name each once, "
                                                      "e.g. log.trackers=[tensorboard,mlflow]"),
    ("peft.target_modules=[c_attn,c_attn]", "peft.target_modules lists c_attn twice"),
])
def test_a_list_of_names_names_each_once(override, needle):
    """A tracker listed twice logged every point twice (TensorBoard) or failed once the model was
    built, on a line blaming its settings (MLflow)."""
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", "peft.method=lora", override])
    assert load_config(None, ["model.config={model_type: gpt2}", "data.path=x",
                              "train.betas=[0.9,0.9]"]).train.betas == [0.9, 0.9]  # numbers may repeat


def test_list_sep_may_be_empty():
    assert load_config(None, ["model.config={model_type: gpt2}", "data.path=x", "data.list_sep=''"]).data.list_sep == ""


def test_every_method_specific_peft_key_is_refused_for_every_other_method():
    """The class, not the example: each key of PeftConfig.METHOD_KEYS, set away from its default,
    under each method that does not take it: one line naming the methods that do."""
    import dataclasses
    import typing

    from shardtune.config.schema import PeftConfig

    methods = typing.get_args(typing.get_type_hints(PeftConfig)["method"])
    other_value = {"r": "4", "alpha": "4", "dropout": "0.1", "target_modules": "[c_fc]", "rslora": "true",
                   "init": "pissa", "lora_plus_ratio": "16", "feedforward_modules": "[c_fc]",
                   "num_virtual_tokens": "20", "prompt_init_text": "Answer:", "adapter_len": "10",
                   "adapter_layers": "1", "quantize": "4bit"}
    assert set(other_value) == set(PeftConfig.METHOD_KEYS)  # a new key needs a value here
    fields = {f.name for f in dataclasses.fields(PeftConfig)}
    assert set(PeftConfig.METHOD_KEYS) == fields - {"method"}  # every key belongs to some method
    for key, takers in PeftConfig.METHOD_KEYS.items():
        for method in set(methods) - set(takers):
            with pytest.raises(UserError, match=re.escape(f"peft.{key} is a setting of peft.method={'/'.join(takers)}, "
                                                          f"not of peft.method={method}")):
                load_config(None, ["model.config={model_type: gpt2}", "data.path=x", f"peft.method={method}",
                                   f"peft.{key}={other_value[key]}"])


# text keys whose comment speaks of files or folders but whose value is not a path
NOT_PATHS = {"data.name": "a Hub dataset's config name", "data.chat_template": "Jinja template text",
             "publish.hub_repo": "a Hub repo id", "log.project": "a tracker's project name"}


def test_every_key_that_names_a_file_or_folder_expands_the_home_folder(tmp_path, monkeypatch):
    """A new key that names a path must join PATH_KEYS (or NOT_PATHS, with why): its `~` is then
    the home folder in a recipe and in an override alike, not a folder named `~` in the cwd."""
    from shardtune.config.schema import PATH_KEYS, config_keys, key_type

    comments = {line.split()[0]: line for line in reference_lines()}
    looks_like_a_path = {key for key in config_keys() if key_type(key) in (str, str | None)
                         and re.search(r"path|dir|folder|file|tokenizer|resume", comments[key], re.I)}
    assert looks_like_a_path - set(NOT_PATHS) == PATH_KEYS
    monkeypatch.setenv("HOME", str(tmp_path))
    overrides = [f"{key}=~/x/{key}" for key in sorted(PATH_KEYS)]
    cfg = load_config(None, [*overrides, "model.config={model_type: gpt2}"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: ~/runs/a\ndata:\n  path: ~user-that-is-not/x\n"
                      "model:\n  config: {model_type: gpt2}\n")
    from_yaml = load_config(recipe)
    for key in PATH_KEYS:
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        assert value == f"{tmp_path}/x/{key}", key
    assert from_yaml.output_dir == f"{tmp_path}/runs/a"
    assert from_yaml.data.path == "~user-that-is-not/x"  # no such user: left as written, as a shell does


def test_a_relative_input_that_exists_is_saved_from_the_root(monkeypatch, tmp_path):
    """A run's config.yaml is read from other working directories (`eval RUN` reads its data): a
    relative data.path or tokenizer there named nothing ("data file 'd.jsonl' not found"). What
    does not exist here (a Hub id) and what a run writes (output_dir) stay as written."""
    from shardtune.config.load import dump_yaml, load_saved_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "tok").mkdir()
    cfg = load_config(None, ["data.path=d.jsonl", "model.tokenizer=./tok", "model.name_or_path=org/m",
                             "output_dir=runs/a"])
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    monkeypatch.chdir(tmp_path / "tok")
    saved = load_saved_config(tmp_path / "config.yaml")
    assert (saved.data.path, saved.model.tokenizer) == (str(tmp_path / "d.jsonl"), str(tmp_path / "tok"))
    assert (saved.model.name_or_path, saved.output_dir) == ("org/m", "runs/a")


@pytest.mark.parametrize("override, want", [
    ("model.config.rope_scaling={type: linear, factor: 2.0}", {"type": "linear", "factor": 2.0}),
    ("model.config.n_layer=[1]", [1]),
    ("model.config.task_specific_params={x: {max_length: 5}}", {"x": {"max_length": 5}}),
])
def test_a_structured_override_inside_a_free_form_mapping_is_its_value(override, want):
    """`model.config.K={...}` stayed the override's text object inside model.config: the resolved
    run's deepcopy then died (`Override.__new__() missing 1 required positional argument`)."""
    import copy
    import pickle

    from shardtune.config.recipe_yaml import Written

    cfg = load_config(None, ["model.config.model_type=gpt2", "data.path=d.jsonl", override])
    value = cfg.model.config[override.split("=")[0].split(".")[-1]]
    assert value == want and type(value) is type(want)
    assert copy.deepcopy(cfg).model.config == cfg.model.config
    text = Written("[1]", [1])  # and the override itself survives a copy
    assert copy.deepcopy(text) == "[1]" and pickle.loads(pickle.dumps(text)).parsed == [1]


def test_overrides_leave_the_callers_defaults_as_they_were():
    """A sweep without a recipe loads the quickstart's defaults once per grid point: a point's
    nested key stayed in them, and the base config (loaded after the points) took it."""
    defaults = {"data": {"path": "x", "seq_len": 64}, "model": {"config": {"model_type": "gpt2", "n_layer": 2}}}
    assert load_config(None, ["data.seq_len=512", "model.config.n_layer=3"], defaults=defaults).data.seq_len == 512
    assert defaults == {"data": {"path": "x", "seq_len": 64}, "model": {"config": {"model_type": "gpt2", "n_layer": 2}}}
    assert load_config(None, [], defaults=defaults).data.seq_len == 64


@pytest.mark.parametrize("recipe_text, overrides, needle", [
    ("", ["train=1", "train.lr=1e-3"], "cannot set train.lr: train is 1, not a mapping"),
    ("train: 5\n", ["train.lr=1e-3"], "cannot set train.lr: train is 5, not a mapping"),
    ("", ["model.config=gpt2", "model.config.n_layer=2"], "cannot set model.config.n_layer: model.config is 'gpt2'"),
    ("", ["train.lr=1e-3", "train.lr.x=1"], "cannot set train.lr.x: train.lr is 0.001, not a mapping"),
    ("", ["train.betas=[0.9,0.95]", "train.betas.x=1"], "train.betas is '[0.9,0.95]', not a mapping"),
])
def test_a_key_set_inside_a_value_that_is_not_a_mapping_is_refused(tmp_path, recipe_text, overrides, needle):
    """`train=1 train.lr=1e-3` trained: the dotted key replaced the value above it with a mapping,
    without a word (a sweep's own train.max_steps did so to `--grid train=1,2`, then called its
    points the same run)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {config: {model_type: gpt2}}\ndata: {path: d.jsonl}\n" + recipe_text)
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(recipe, overrides)


def test_a_key_set_inside_an_empty_section_fills_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {config: {model_type: gpt2}}\ndata: {path: d.jsonl}\ntrain:\n")
    assert load_config(recipe, ["train.lr=1e-3"]).train.lr == 1e-3
    assert load_config(recipe, ["train=", "train.max_steps=3"]).train.max_steps == 3


@pytest.mark.parametrize("revision", ["feat:x", "a..b", "x.lock", "a/b.lock/c", "x/", "x.", ".x", "a/.b", "a//b",
                                      "a@{b", "@", "HEAD", "a b", "a~1", "a^", "a?", "a*", "a[", "a\\b", "-x", "/x",
                                      "a\tb"])
def test_a_publish_revision_is_a_git_branch_name(revision):
    """The Hub's branches are git refs: a name git refuses (`git check-ref-format --branch`) was
    refused by the Hub only at the first upload, as a warning, after the run had trained for it."""
    with pytest.raises(UserError, match=re.escape(f"publish.revision={revision!r} is not a branch name")):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=x", "publish.hub_repo=me/m",
                           "publish.checkpoints=false", f"publish.revision={revision}"])


@pytest.mark.parametrize("revision", ["main", "dev", "feat/x", "v1.0", "user@host", "release-2024_01", "été"])
def test_a_publish_revision_git_takes_is_taken(revision):
    cfg = load_config(None, ["model.config={model_type: gpt2}", "data.path=x", "publish.hub_repo=me/m",
                             "publish.checkpoints=false", f"publish.revision={revision}"])
    assert cfg.publish.revision == revision


def alias_pairs() -> list[tuple[str, str]]:
    """(dotted alias, dotted field) for every KEY_ALIASES entry of the schema."""
    import dataclasses
    import typing

    from shardtune.config.schema import RunConfig

    pairs, todo = [], [(RunConfig, "")]
    while todo:
        cls, prefix = todo.pop()
        pairs += [(prefix + alias, prefix + field) for alias, field in getattr(cls, "KEY_ALIASES", {}).items()]
        todo += [(tp, f"{prefix}{name}.") for name, tp in typing.get_type_hints(cls).items()
                 if dataclasses.is_dataclass(tp)]
    return pairs


@pytest.mark.parametrize("alias, field", alias_pairs())
@pytest.mark.parametrize("recipe_keys, override", [((0, 1), 0), ((1, 0), 1), ((0, 1), 1), ((0,), 1), ((1,), 0)])
def test_a_key_spelled_two_ways_is_one_key(tmp_path, alias, field, recipe_keys, override):
    """`checkpoint.async` is `checkpoint.async_save`: a recipe giving both with different values kept the
    last one without a word, and an override of one spelling lost to the recipe's other one after it."""
    names = (alias, field)
    recipe = tmp_path / "r.yaml"
    section, _, _ = field.rpartition(".")
    lines = "".join(f"  {names[i].rpartition('.')[2]}: {'true' if n == 0 else 'false'}\n"
                    for n, i in enumerate(recipe_keys))
    recipe.write_text(f"model: {{name_or_path: m}}\ndata: {{path: d}}\n{section}:\n{lines}")
    if len(recipe_keys) == 2:  # true and false: one line naming both spellings
        with pytest.raises(UserError, match=rf"{re.escape(names[recipe_keys[0]])}=True and "
                                            rf"{re.escape(names[recipe_keys[1]])}=False set the same key"):
            load_config(recipe)
    cfg = load_config(recipe, [f"{names[override]}=true"]).to_dict()
    assert cfg[section][field.rpartition(".")[2]] is True


@pytest.mark.parametrize("override, want", [("data.template={q}  # note", "{q}"),
                                            ("data.template=Q: {q}\nA: {a}  # note", "Q: {q}\nA: {a}"),
                                            ('data.template=Q: "{q} # 1"  # note', 'Q: "{q} # 1"'),
                                            ("data.template=Q: {q} # note", "Q: {q}"),
                                            ("output_dir=runs/x  # note", "runs/x")])
def test_a_comment_after_an_override_is_no_part_of_its_text(override, want):
    """`runs/x  # note` was runs/x (YAML's comment), `{q}  # note` the template '{q}  # note': a text key
    given text that YAML reads as a mapping kept the comment, and trained on it."""
    key = override.partition("=")[0]
    cfg = load_config(None, ["model.name_or_path=m", "data.path=d", override]).to_dict()
    assert cfg[key.partition(".")[0]][key.partition(".")[2]] == want if "." in key else cfg[key] == want
