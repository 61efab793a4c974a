"""Property-based search for bad input that escapes as a traceback (Hypothesis).

Over the command line and the input files: `key=value` overrides of every config key (read from
the schema) with values of the wrong type, out of range, NaN/inf, huge or empty; `model.config`'s own
keys for every architecture; every option of every command (read from the parser), also on a real
model; corrupted or oddly written recipes (YAML tags, anchors, encodings), data files (encodings,
structures), model folders (config.json) and checkpoints (meta.json).
For every run: exit 0 or 2, never a traceback, at most two lines on stderr, and no file that
existed before changed. Runs in-process; most inputs stop at config load, before torch work.

CI runs a few examples per property with a fixed seed (derandomized); for a longer search:
    SHARDTUNE_FUZZ_EXAMPLES=2000 python -m pytest -q -p no:cacheprovider tests/e2e/test_fuzz.py
(random examples each time; `--hypothesis-seed N` repeats a search, `-k <property>` runs one property).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
from pathlib import Path

import pytest
import yaml
from archs import ARCHS, arch_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_errors import TINY_GPT2, library_logs_to_stderr, qs_assets  # noqa: F401 - a shared fixture

from conftest import AGENT_VARS, main_in_process
from shardtune.cli.main import main
from shardtune.config.schema import config_keys
from shardtune.errors import EXIT_USAGE

EXAMPLES = int(os.environ.get("SHARDTUNE_FUZZ_EXAMPLES", "0"))
# a longer search draws new examples each run (`--hypothesis-seed N` repeats one); CI's few are fixed
settings.register_profile("ci", derandomize=not EXAMPLES, deadline=None, database=None, print_blob=True,
                          suppress_health_check=list(HealthCheck))
settings.load_profile("ci")


def examples(ci: int) -> settings:
    """`ci` examples in the suite; SHARDTUNE_FUZZ_EXAMPLES for a longer search (a share of it per property)."""
    return settings(max_examples=max(ci, EXAMPLES * ci // 40) if EXAMPLES else ci)


ODD_VALUES = ["", " ", "nan", ".nan", ".inf", "-.inf", "1e309", "-1", "0", "-0.0", "1", "2", str(2 ** 63),
              str(2 ** 64), str(-2 ** 63 - 1), "9" * 400, "1e-320", "true", "null", "~", "[]", "{}", "[1, 2]",
              "[.nan]", "{a: 1}", "{1: 2}", "[[[[[]]]]]", "&a [*a, *a]", "'", "\"", "{", "[", "a\nb", "x" * 300,
              "{x:10000000000}", "{0}", "{x!z}", "../..", "/dev/null", "-", "--help", "a=b", "!!python/none ''",
              "!!bool 2", "!!timestamp x", "{model_type: t5}", "{model_type: gpt2, n_head: 3}",
              "{model_type: gpt2, n_embd: .nan}"]
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
VALUES = st.one_of(st.sampled_from(ODD_VALUES), st.integers(-2 ** 70, 2 ** 70).map(str),
                   st.floats().map(repr), TEXT)


@pytest.fixture(scope="module")
def world(tmp_path_factory, qs_assets):
    """The setup, with the environment of a lone offline process run from its folder."""
    root = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as mp:
        for name in AGENT_VARS:
            mp.delenv(name, raising=False)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(root / "hf-datasets"))
        import datasets

        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf-datasets"))
        mp.chdir(root)
        yield FuzzWorld.build(root, qs_assets)


@examples(60)
@given(overrides=st.lists(st.tuples(st.sampled_from(config_keys()), VALUES), min_size=1, max_size=3))
def test_overrides_of_every_key(world, overrides):
    """`slurm` loads and validates the whole config and stops: the config path without torch."""
    words = [f"{key}={value}" for key, value in overrides]
    run_and_check(world, ["slurm", world.recipe, *words, "--nodes", "1", "--gpus-per-node", "1"])


# the values that broke a check before (an int too large for a float, one over Python's 4300-digit limit);
# every key takes each, deterministically: a draw from VALUES x config_keys() may miss a key for long
WORST = ["9" * 400, "9" * 5000, "1e309", "[]", "{}", "[" + "9" * 400 + "]"]


def test_every_key_takes_the_worst_values(world):
    from shardtune.config.load import load_config
    from shardtune.errors import UserError

    for key, value in itertools.product(config_keys(), WORST):
        try:
            load_config(world.recipe, [f"{key}={value}"])
        except UserError as exc:
            assert "\n" not in str(exc), (key, value, str(exc))


def command_options() -> dict[str, tuple[list[str], list[str]]]:
    """Per command, its options that take a value and its flags, read from the parser: a new option is
    fuzzed with no change here."""
    import argparse

    from shardtune.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, parser in sub.choices.items():
        named = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        found[name] = ([a.option_strings[-1] for a in named if a.nargs != 0],
                       [a.option_strings[-1] for a in named if a.nargs == 0])
    return found


OPTIONS = command_options()


@examples(40)
@given(command=st.sampled_from(sorted(OPTIONS)), data=st.data())
def test_options_of_every_command(world, command, data):
    """Bad option values (one or two options, `--opt=value` so a value may start with `-`; paths
    that exist, of files the world holds) are refused in one line before the command starts, or
    the command runs as far as its positionals let it. Each example runs in a folder of its own:
    a relative output it writes (`--out=x`) is its own, not an earlier example's to replace."""
    valued, flags = OPTIONS[command]
    chosen = data.draw(st.lists(st.sampled_from(valued), min_size=1, max_size=2, unique=True))
    values = st.one_of(VALUES, st.sampled_from(world.existing_paths()))
    extra = [f"{option}={data.draw(values)}" for option in chosen]
    extra += data.draw(st.lists(st.sampled_from(flags), max_size=1)) if flags else []
    here = world.fresh_path("cwd") / "here"
    here.mkdir(parents=True)
    with contextlib.chdir(here):
        run_and_check(world, world.command_line(command, extra))


# keys most configs read, beside each architecture's own (its tiny config's, tests/archs.py)
HF_KEYS = ["model_type", "vocab_size", "max_position_embeddings", "hidden_size", "num_attention_heads",
           "num_key_value_heads", "head_dim", "torch_dtype", "dtype", "rope_scaling", "rope_theta", "hidden_act",
           "attn_implementation", "_attn_implementation", "architectures", "tie_word_embeddings", "pad_token_id",
           "eos_token_id", "bos_token_id", "sliding_window", "partial_rotary_factor", "quantization_config",
           "layer_norm_eps", "rms_norm_eps", "use_cache", "initializer_range", "num_hidden_layers"]


@examples(10)
@given(arch=st.sampled_from(sorted(ARCHS)), data=st.data())
def test_model_config_values(world, arch, data):
    """`model.config.<key>=value` on a tiny config of every architecture (or a saved GPT-2's), with odd
    values (transformers checks few): `slurm` checks the model's config and builds its skeleton on meta."""
    config = arch_config(arch)
    keys = sorted({*config, *HF_KEYS})
    edits = data.draw(st.lists(st.tuples(st.sampled_from(keys), st.one_of(VALUES, CONFIG_NUMBERS.map(str))),
                               min_size=1, max_size=2))
    source = data.draw(st.sampled_from([f"model.config={json.dumps(config)}",  # or set on a model folder's config
                                        f"model.name_or_path={world.model_folder()}"]))
    words = [source, *(f"model.config.{key}={value}" for key, value in edits)]
    run_and_check(world, ["slurm", world.recipe, *words, "--nodes", "1", "--gpus-per-node", "1"])


# what launches ranks or takes the network is left to the properties above (they stop before it)
REAL_MODEL_OPTIONS = {c: [o for o in OPTIONS[c][0] if o not in ("--nproc", "--mauve-featurizer", "--compare")]
                      for c in ("eval", "generate")}


@examples(4)
@given(command=st.sampled_from(sorted(REAL_MODEL_OPTIONS)), data=st.data())
def test_options_on_a_real_model(world, command, data):
    """`eval` and `generate` of a saved tiny model, their options' values past the parser's checks
    (huge counts, odd text, existing paths): refused in one line, or run on the tiny model."""
    chosen = data.draw(st.lists(st.sampled_from(REAL_MODEL_OPTIONS[command]), min_size=1, max_size=2, unique=True))
    plausible = st.sampled_from(["text", "instruct", "chat", "cpu", "auto", "validation", "train", "other", "prompt",
                                 "rouge,bleu", "diversity", "mauve", "rouge,,", "0.5", "1e-9", "0.999999"])
    values = st.one_of(VALUES, st.integers(0, 3000).map(str), plausible, st.sampled_from(world.existing_paths()))
    base = {"generate": ["--prompt", "hi", "--max-new-tokens", "2"],  # options after these replace them
            "eval": ["--data", world.data_file(), *data.draw(st.sampled_from(
                [["--max-batches", "1", "--micro-batch-size", "2"], ["--generate", "2", "--max-new-tokens", "2"]]))]}
    extra = base[command] + [f"{option}={data.draw(values)}" for option in chosen]
    here = world.fresh_path("cwd")
    here.mkdir(parents=True)
    with contextlib.chdir(here):
        run_and_check(world, [command, str(world.model_folder()), *extra])


def corruptions(text: bytes) -> st.SearchStrategy[bytes]:
    """Truncations, random bytes spliced in, duplicated lines, wrong JSON types, random files."""
    n = len(text)
    cut = st.integers(0, n).map(lambda i: text[:i])
    splice = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=8)).map(
        lambda t: text[:t[0]] + t[1] + text[t[0]:])
    lines = text.splitlines(keepends=True)
    dup = st.integers(0, max(len(lines) - 1, 0)).map(lambda i: b"".join(lines[:i + 1] + lines[i:]))
    swap = st.sampled_from([b"[]", b"5", b"null", b'"text"', b"{}", b"{\"a\": NaN}", b"[" * 5000, b"\xff\xfe"])
    return st.one_of(cut, splice, dup, swap, st.binary(max_size=64))


# YAML a person writes (or a tool emits): tags, anchors, merges, block scalars, YAML 1.1 words, dates
YAML_VALUES = [b"!!binary aGk=", b"!!set {a, b}", b"!!omap [a: 1]", b"!!pairs [a: 1]", b"2024-01-01",
               b"2001-12-14t21:59:43.10-05:00", b"!!python/object:os.system x", b"!!str", b"!!float 1", b"!!int 0x1f",
               b"0o17", b"1_000", b"0x10", b"yes", b"on", b"off", b"~", b"!custom 1", b"&x 1", b"*x", b"*nowhere",
               b"|\n    text\n", b">-\n    folded\n", b"{<<: {a: 1}}", b"[a, {b: c}]", b"? a", b"''", b'"\\x"',
               b'"\\u0000"', b"!!null x", b"!!bool 2", b"!!timestamp x", b"1:2:3", b"+.5", b"-0b11", b"\t1"]


def odd_yaml(text: bytes) -> st.SearchStrategy[bytes]:
    """A recipe whole but for one value written as odd YAML, or the file's form changed (a BOM, CRLF,
    tabs, several documents, directives, a merge key at the top, another encoding)."""
    lines = text.splitlines(keepends=True)
    keyed = [i for i, line in enumerate(lines) if b":" in line]
    one_value = st.tuples(st.sampled_from(keyed), st.sampled_from(YAML_VALUES)).map(
        lambda t: b"".join([*lines[:t[0]], lines[t[0]].split(b":")[0] + b": " + t[1] + b"\n", *lines[t[0] + 1:]]))
    whole = st.sampled_from([b"\xef\xbb\xbf" + text, text.replace(b"\n", b"\r\n"), text.replace(b"  ", b"\t"),
                             text + b"---\n" + text, b"%YAML 1.1\n---\n" + text, b"%YAML 9.9\n---\n" + text,
                             b"base: &b\n  " + text.replace(b"\n", b"\n  ") + b"\n<<: *b\n", text + b"...\n",
                             text.decode().encode("utf-16"), text.replace(b"\n", b"\r"), text + b"\x00"])
    return st.one_of(one_value, whole)


@examples(30)
@given(data=st.data())
def test_corrupt_recipes(world, data):
    original = Path(world.recipe).read_bytes()
    text = data.draw(st.one_of(corruptions(original), odd_yaml(original)))
    path = world.scratch_file("recipe.yaml", text)
    run_and_check(world, ["slurm", str(path), "--nodes", "1", "--gpus-per-node", "1"])


@examples(8)
@given(data=st.data())
def test_corrupt_model_folders(world, data):
    """config.json of a model folder damaged: `plan` reads it (and builds the model on meta) first."""
    text = data.draw(corruptions(world.model_config))
    folder = world.scratch_folder("model", {"config.json": text})
    run_and_check(world, ["plan", world.recipe, f"model.name_or_path={folder}", "model.random_init=true",
                          "--gpus", "1", "--gpu", "T4"])


CONFIG_NUMBERS = st.sampled_from([0, 1, 2, 3, 7, 33, 64, 300, 2 ** 20, -1])


@examples(6)
@given(edits=st.dictionaries(st.sampled_from(["n_embd", "n_layer", "n_head", "n_positions", "vocab_size",
                                              "n_inner", "tie_word_embeddings", "model_type"]),
                             st.one_of(CONFIG_NUMBERS, st.booleans(), st.sampled_from(["llama", "opt", "gpt2"])),
                             min_size=1, max_size=2))
def test_model_folder_config_that_does_not_fit_its_weights(world, edits):
    """A saved model's config.json edited (sizes, depth, ties, another model type), then `generate`
    loads it: refused in one line, or run (test_errors' test_model_folder_whose_weights_do_not_fit_its_config
    pins which edits are refused before the weights load)."""
    folder = world.fresh_path("model")
    import shutil

    shutil.copytree(world.model_folder(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    run_and_check(world, ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"])


@examples(8)
@given(name=st.sampled_from(["meta.json", "config.json", ".metadata", "tokenizer/tokenizer.json"]), data=st.data())
def test_corrupt_checkpoints(world, name, data):
    """One file of a real checkpoint damaged, then `export` (a whole one exports in about a second)."""
    import shutil

    folder = world.fresh_path("step-1")
    shutil.copytree(world.checkpoint, folder)
    (folder / name).write_bytes(data.draw(corruptions((folder / name).read_bytes())))
    run_and_check(world, ["export", str(folder), str(world.fresh_path("exported"))])


@examples(3)
@given(name=st.sampled_from(["rng-rank00000.pt", "__0_0.distcp", "meta.json"]), data=st.data())
def test_corrupt_checkpoints_on_resume(world, name, data):
    """One file of a run's newest checkpoint damaged, then `train resume=auto`: refused with the run
    as it was (metrics of steps after the checkpoint kept), or resumed."""
    import shutil

    run = world.fresh_path("run")
    shutil.copytree(world.trained_run(), run)
    folder = run / "checkpoints" / "step-000001"
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (1, 2, 3)))
    (folder / name).write_bytes(data.draw(corruptions((folder / name).read_bytes())))
    run_and_check(world, ["train", world.recipe, "resume=auto", "train.max_steps=2", f"output_dir={run}"],
                  resumed=True)


@examples(3)
@given(data=st.data())
def test_corrupt_data_files(world, data):
    """A damaged training file: refused with one line, or trained on for one step."""
    text = data.draw(st.one_of(corruptions(world.data_text), st.sampled_from(world.odd_data)))
    path = world.scratch_file(data.draw(st.sampled_from(["train.jsonl", "train.json", "train.txt", "train.csv"])), text)
    run_and_check(world, ["train", world.recipe, f"data.path={path}", f"output_dir={world.fresh_path('run')}"])


@examples(4)
@given(name=st.sampled_from(["metrics.jsonl", "sweep.json"]), data=st.data())
def test_corrupt_run_files(world, name, data):
    """A run's metrics.jsonl damaged, then `report`; a sweep's sweep.json damaged, then the same sweep
    again (whole, it has every trial done: only the outputs are rewritten)."""
    import shutil

    folder = world.fresh_path("run")
    shutil.copytree(world.sweep_out, folder)
    (folder / name).write_bytes(data.draw(corruptions((folder / name).read_bytes())))
    if name == "metrics.jsonl":
        run_and_check(world, ["report", str(folder), "--out", str(world.fresh_path("report"))])
    else:
        run_and_check(world, ["sweep", world.recipe, *world.sweep_args, "--out", str(folder)])


NUMBERS = st.one_of(st.floats(), st.integers(-2 ** 1100, 2 ** 1100), st.sampled_from([1e308, -1e308, 5e-324]))


@examples(3)
@given(rows=st.lists(st.fixed_dictionaries({"step": st.one_of(st.integers(0, 10), st.integers(0, 2 ** 1100))},
                                           optional={k: NUMBERS for k in ("loss", "eval_loss", "lr", "tokens_per_s",
                                                                          "mem_rss_peak_gib", "grad_norm")}),
                     min_size=1, max_size=6))
def test_metrics_with_extreme_numbers(world, rows):
    """metrics.jsonl whole but holding numbers no run writes (1e308, NaN, 2**1100): `report` plots what it
    can and summarises, or refuses in one line."""
    folder = world.fresh_path("run")
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_and_check(world, ["report", str(folder), "--out", str(world.fresh_path("report"))])


def test_the_checks_see_a_traceback(world):
    """The property can fail: an exception that escapes main is reported, not swallowed."""
    with pytest.raises(AssertionError, match="escaped"):
        run_and_check(world, ["report", str(world.root / "x")], main=lambda argv: 1 / 0)


def test_schema_walk_sees_every_key():
    keys = config_keys()
    assert {"train.lr", "data.template", "checkpoint.async_save", "model.config", "output_dir"} <= set(keys)
    assert len(keys) == len(set(keys)) > 80


# ----------------------------------------------------------------------------- the world and the check


class FuzzWorld:
    """A tiny valid setup (recipe, data, model config, checkpoint meta) that the properties damage,
    and scratch space for each example's files."""

    def __init__(self, root: Path, recipe: str, data_text: bytes, model_config: bytes, meta_json: bytes):
        self.root, self.recipe, self.data_text = root, recipe, data_text
        self.model_config, self.meta_json = model_config, meta_json
        self.counter = itertools.count()
        rows = [{"text": 5}, {"text": None}, {"text": ""}, {"text": {"a": "b"}}, {"text": [1, 2]}, {"other": "x"}]
        self.odd_data = [b"".join(json.dumps(row).encode() + b"\n" for _ in range(40)) for row in rows]
        # the same documents in other encodings and structures: a BOM, UTF-16, Latin-1, CRLF, one JSON array
        # or object, a CSV-like text, NUL bytes, one huge line
        docs = [json.loads(line) for line in data_text.splitlines() if line.strip()]
        self.odd_data += [b"\xef\xbb\xbf" + data_text, data_text.decode().encode("utf-16"),
                          data_text.decode().encode("latin-1", "replace"), data_text.replace(b"\n", b"\r\n"),
                          json.dumps(docs).encode(), json.dumps({"data": docs}).encode(),
                          json.dumps({"text": [d["text"] for d in docs]}).encode(),
                          b"text\n" + b"".join(json.dumps(d["text"]).encode() + b"\n" for d in docs),
                          data_text.replace(b"\n", b"\x00\n"), b" ".join(data_text.splitlines()) + b"\n",
                          "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-16-le")]

    @classmethod
    def build(cls, root: Path, assets: dict) -> FuzzWorld:
        from transformers import AutoConfig
        data_text = b"".join(Path(assets["train"]).read_bytes().splitlines(keepends=True)[:60])
        tree = {"model": {"tokenizer": assets["tokenizer"], "config": dict(TINY_GPT2)},
                "data": {"path": assets["train"], "seq_len": 32},
                "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 1, "lr": 1e-3},
                "eval": {"max_batches": 1, "at_start": False}, "log": {"progress": False, "every_steps": 1},
                "save_final": False}
        recipe = root / "tiny.yaml"
        recipe.write_text(yaml.safe_dump(tree, sort_keys=False))
        gpt2 = dict(TINY_GPT2)
        model_config = AutoConfig.for_model(gpt2.pop("model_type"), **gpt2).to_json_string().encode()
        from shardtune.config.load import load_config

        meta = {"format": 2, "step": 1, "world_size": 1, "config": load_config(str(recipe)).to_dict(),
                "train_state": {"step": 1, "tokens_seen": 128.0}}
        world = cls(root, str(recipe), data_text, model_config, json.dumps(meta).encode())
        world.checkpoint = world.make_checkpoint(assets["tokenizer"])
        world.sweep_out = world.make_sweep_folder()
        return world

    sweep_args = ["--grid", "precision=fp32", "--steps", "1"]

    def make_sweep_folder(self) -> Path:
        """A finished one-trial sweep's state (sweep.json) and a run's metrics.jsonl, in one folder."""
        from shardtune.sweep.grid import Sweep, parse_grid, set_device

        folder = self.root / "finished-sweep"
        folder.mkdir()
        sweep = Sweep(self.recipe, [], parse_grid(self.sweep_args[1:2]), steps=1)
        set_device(sweep)  # the trials' device is part of the state (a GPU machine's sweep is another)
        record = {"name": "precision-fp32", "point": {"precision": "fp32"}, "micro_batch": 2, "seconds": 3.0,
                  "exit_code": 0, "status": "ok", "tokens_per_s": 900.0, "step_time_s": 0.1, "accumulation": 2,
                  "mem_rss_gib": 0.5, "mem_live_gib": 0.01, "predicted_gib": None}
        (folder / "sweep.json").write_text(json.dumps({"spec": sweep.spec(), "trials": {record["name"]: record}}))
        rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 900.0, "time": s * 0.1}
                for s in range(1, 6)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    def make_checkpoint(self, tokenizer: str) -> Path:
        """A real one-process DCP checkpoint of the tiny model, as `export` reads it."""
        import shutil
        import warnings

        import torch.distributed.checkpoint as dcp
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = self.root / "checkpoint-step-1"
        hf_config = AutoConfig.from_pretrained(self.scratch_folder("cfg", {"config.json": self.model_config}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": AutoModelForCausalLM.from_config(hf_config).state_dict()}, checkpoint_id=folder,
                     no_dist=True)
        (folder / "config.json").write_bytes(self.model_config)
        (folder / "meta.json").write_bytes(self.meta_json)
        shutil.copytree(tokenizer, folder / "tokenizer")
        return folder

    def trained_run(self) -> Path:
        """The output folder of a real one-step run with its checkpoint (made once, on first use)."""
        folder = self.root / "trained"
        if not folder.is_dir():
            with contextlib.redirect_stdout(io.StringIO()):
                rc = main(["train", self.recipe, "checkpoint.every_steps=1", f"output_dir={folder}"])
            assert rc == 0 and (folder / "checkpoints" / "step-000001" / "rng-rank00000.pt").is_file()
        return folder

    def model_folder(self) -> Path:
        """A saved model (weights, config, tokenizer) of the tiny GPT-2, made on first use."""
        folder = self.root / "saved-model"
        if not folder.is_dir():
            import shutil

            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.scratch_folder("cfg", {"config.json": self.model_config}))
            config.vocab_size = 300
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            for file in Path(yaml.safe_load(Path(self.recipe).read_text())["model"]["tokenizer"]).iterdir():
                shutil.copy(file, folder)
        return folder

    def data_file(self) -> str:
        """A small training file (the world's data text), made on first use."""
        path = self.root / "data" / "train.jsonl"
        if not path.is_file():
            path.parent.mkdir()
            path.write_bytes(self.data_text)
        return str(path)

    def existing_paths(self) -> list[str]:
        """Files and folders that exist (a recipe, a checkpoint, a run's files, the working folder), as
        an option's value: none may be overwritten or removed."""
        return [self.recipe, ".", "..", str(self.root), str(self.checkpoint), str(self.checkpoint / "meta.json"),
                str(self.sweep_out), str(self.sweep_out / "metrics.jsonl")]

    def fresh_path(self, name: str) -> Path:
        return self.root / "scratch" / f"{next(self.counter)}-{name}"

    def scratch_file(self, name: str, data: bytes) -> Path:
        path = self.fresh_path("f") / name
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        return path

    def scratch_folder(self, name: str, files: dict[str, bytes]) -> Path:
        folder = self.fresh_path(name)
        folder.mkdir(parents=True)
        for file, data in files.items():
            (folder / file).write_bytes(data)
        return folder

    def command_line(self, command: str, extra: list[str]) -> list[str]:
        """A command with positionals that stop it quickly once its options are accepted: an
        invalid config value (commands that load one) or a model, checkpoint or run that is not there."""
        missing, stop = str(self.root / "not-there"), "train.micro_batch_size=0"
        return {"eval": ["eval", missing], "generate": ["generate", missing, "--prompt", "hi"],
                "plan": ["plan", self.recipe, stop, "--gpus", "1", "--gpu", "T4"],
                "slurm": ["slurm", self.recipe, "--nodes", "1", "--gpus-per-node", "1"],
                "sweep": ["sweep", self.recipe, stop, "--grid", "precision=fp32"],
                "export": ["export", missing, str(self.fresh_path("x"))], "train": ["train", self.recipe, stop],
                "report": ["report", missing], "download": ["download", "model:nobody/nothing"]}[command] + extra


def snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def run_and_check(world: FuzzWorld, argv: list[str], must_fail: bool = False, main=main, resumed=False) -> int:
    """Run `shardtune argv` in-process and assert the property: exit 0 or 2 (2 when `must_fail`),
    no traceback, at most two lines on stderr, no file that existed before changed (`resumed`: unless
    it exits 0, a resume that continues the run's files)."""
    before = snapshot(world.root)
    rc, err = main_in_process(argv, main, library_logs_to_stderr)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc in ((EXIT_USAGE,) if must_fail else (0, EXIT_USAGE)), f"rc={rc} for {argv!r}: {err}"
    assert "Traceback" not in err, f"{argv!r}: {err}"
    assert len(lines) <= 2, f"{len(lines)} lines on stderr for {argv!r}:\n{err[:3000]}"
    changed = [p for p, stamp in before.items() if snapshot_one(Path(p)) != stamp and not (resumed and rc == 0)]
    assert not changed, f"{argv!r} changed {changed[:3]}"
    return rc


def snapshot_one(path: Path):
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None
