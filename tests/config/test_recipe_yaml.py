"""A value means the same in a recipe, as a `key=value` override and in a run's saved config.yaml,
for every key of the schema, whatever YAML 1.1 makes of its text (`007`, `0x10`, `1.10`, `12:30`,
`2024-01-01`, `yes`, `.nan`): all load the same config or refuse; a key typed as text takes the
text as written. The words shardtune hands its ranks, trials and jobs read back as written."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardtune.config.load import dump_yaml, load_config
from shardtune.config.schema import config_keys, key_type
from shardtune.errors import UserError

BASE = {"model": {"config": {"model_type": "gpt2"}}, "data": {"path": "d.jsonl"}}
# plain scalars YAML 1.1 reads as something other than text, beside their quoted and ordinary forms
ODD = ["007", "0x10", "0o17", "010", "1_000", "1.10", "1.50", "1e3", "1.5e-3", "12:30", "190:20:30", ".inf",
       "-.inf", ".nan", "2024-01-01", "2024-01-01 10:00:00", "2001-12-14t21:59:43.10-05:00", "yes", "no", "on",
       "off", "true", "null", "~", "'007'", '"1.10"', '"1e5"', "abc", "-1", "0", "3", "0.5", "[a, 1]", "[007, 1.10]",
       "{}"]
TEXT_KEYS = [k for k in config_keys() if str in (key_type(k), *typing.get_args(key_type(k)))]


def nested(key: str, text: str) -> str:
    """`a.b: text` as a recipe's lines, beside BASE (a key inside model or data goes into its section)."""
    *path, last = key.split(".")
    tree = {**BASE}
    node = tree
    for part in path:
        node[part] = dict(node.get(part, {}))
        node = node[part]
    node[last] = "\0"
    dumped = yaml.safe_dump(tree, sort_keys=False)
    return dumped.replace("'\\0'", text).replace('"\\0"', text)


def loaded(recipe, overrides):
    try:
        cfg = load_config(recipe, overrides)
    except UserError:
        return "refused"
    tree = cfg.to_dict()
    tree.pop("recipe")
    return tree


@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from([*config_keys(), "model.config.release"]),
       text=st.one_of(st.sampled_from(ODD), st.integers(-10 ** 6, 10 ** 6).map(str)))
def test_a_value_means_the_same_in_a_recipe_and_an_override(tmp_path, monkeypatch, key, text):
    monkeypatch.chdir(tmp_path)  # the values name no file here
    is_text = key in TEXT_KEYS
    assume(not (is_text and isinstance(yaml.safe_load(text), (list, dict))))  # override text, by design
    recipe = tmp_path / "r.yaml"
    recipe.write_text(nested(key, text))
    assert "\0" not in recipe.read_text()
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(BASE))
    from_recipe, from_override = loaded(recipe, []), loaded(base, [f"{key}={text}"])
    assert from_recipe == from_override, (key, text)
    if from_recipe != "refused":  # and a run's saved config.yaml (eval RUN, resume) reads back as the run
        saved = tmp_path / "config.yaml"
        saved.write_text(dump_yaml(load_config(recipe)))
        assert loaded(saved, []) == from_recipe, (key, text)
    node = yaml.compose(text)
    kind = node.tag.rsplit(":", 1)[-1] if isinstance(node, yaml.ScalarNode) and node.style is None else None
    # a text key takes a plain number or date as written; a free mapping (model.config) a date, as JSON would
    if from_recipe != "refused" and kind in (("int", "float", "timestamp") if is_text else ("timestamp",)) \
            and (is_text or key.startswith("model.config.")):
        value = from_recipe
        for part in key.split("."):
            value = value[part]
        assert value == text, (key, text, value)


@pytest.mark.parametrize("override, want", [
    ("output_dir=007", "007"), ("publish.revision=1.10", "1.10"), ("data.name=2024-01-01", "2024-01-01"),
    ("data.split=12:30", "12:30"), ("train.micro_batch_size=0x10", 16), ("train.lr=1e-3", 1e-3),
    ("peft.target_modules=[007, 1.10]", ["007", "1.10"]), ("data.text_field='007'", "007"),
])
def test_a_number_is_a_number_only_for_a_number_key(override, want):
    key, _, _ = override.partition("=")
    cfg = load_config(None, ["model.config={model_type: gpt2}", "data.path=d.jsonl", "peft.method=lora", override])
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    assert value == want and type(value) is type(want)


@pytest.mark.parametrize("value", ["!!binary aGk=", "!!set {a}", "[[!!binary aGk=]]", "{x: !!set {a}}",
                                   "{2024-01-01: 1}"])
def test_model_config_takes_only_what_a_config_json_holds(value):
    """A bytes or set value inside model.config loaded, then crashed the run mid-build (transformers
    writes the config as JSON)."""
    with pytest.raises(UserError, match="which a config.json cannot hold"):
        load_config(None, ["model.config={model_type: gpt2}", "data.path=d.jsonl", f"model.config.foo={value}"])


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(text=st.one_of(st.sampled_from(["runs/exp #2", "#1", "no", "null", "'q'", "&a x", " x", "x\ny", "[a]", "007"]),
                      st.text(st.characters(exclude_categories=("Cs",)), max_size=12)))
def test_an_override_word_reads_back_as_its_text(text):
    from shardtune.config.load import override_word, parse_override

    assert parse_override(override_word("output_dir", text)) == ("output_dir", text)


FOLDERS = ["runs/exp #2", "no", "null", "x 'y'"]  # YAML: runs/exp and a comment, false, None, x 'y' (kept)


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_folder_handed_to_ranks_trials_and_jobs_is_the_one_given(folder, assets, tmp_path, monkeypatch):
    """The parent of `train --nproc 2`, a sweep's trials and a Slurm job's train got `output_dir=runs/exp #2`,
    which they read as runs/exp: the ranks wrote into another folder than the one the parent held."""
    import shlex

    import shardtune.cli.train as cli_train
    from conftest import tiny_overrides
    from shardtune.cli.main import main
    from shardtune.config.load import override_word, parse_override
    from shardtune.launch.slurm import sbatch_script
    from shardtune.sweep.grid import Sweep

    monkeypatch.chdir(tmp_path)
    workers = []
    monkeypatch.setattr(cli_train, "_launch_preemptible", lambda n, worker, out: workers.append(worker) or 0)
    quoted = override_word("output_dir", folder)  # as a user quotes it for YAML: output_dir="runs/exp #2"
    assert main(["train", *tiny_overrides(assets, tmp_path), quoted, "--nproc", "2"]) == 0
    script = sbatch_script("r.yaml", folder, 1, 2, overrides=[], offline=True)
    job = next(line for line in script.splitlines() if "resume=auto" in line)
    trial = Sweep("r.yaml", [], []).trial_overrides({}, None, Path(folder))
    handed = {"rank": workers[0], "job": shlex.split(job), "trial": trial}
    for who, words in handed.items():
        given = [parse_override(w)[1] for w in words if w.startswith("output_dir=")]
        assert given[-1:] == [folder], (who, words)


@pytest.mark.parametrize("override", ['model.config.x="1e5"', 'model.config.x=["1.5e3", 2e-3]', 'output_dir="1e3"'])
def test_a_saved_config_reads_back_as_the_run(tmp_path, override):
    """config.yaml wrote the text "1e5" plain, and the loader (which reads 1e5 as a number, as JSON
    does) read it back as 100000.0: `eval RUN` and a resume saw another model config."""
    cfg = load_config(None, ["model.config={model_type: gpt2}", "data.path=d.jsonl", override])
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    assert load_config(tmp_path / "config.yaml").to_dict() == cfg.to_dict()
