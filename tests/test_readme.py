"""The README is the manual; these checks keep it the product's. Every `shardtune ...` command line it
shows (and docs/'s, and the recipes' comments') goes through the real `main` (parser, option types, the
only-with rules) with each command's work replaced by loading the config of its recipe, overrides and
sweep values; a synopsis's `[--opt value]` is that option's default; an option or a config `key=value`
in inline code exists (its `a|b` alternatives among the choices); and the config defaults and `--gpu`
names the README states in its fixed forms are the code's. Argparse and YAML only: no run, no model."""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import shlex

import pytest
import yaml

from conftest import ROOT

SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "recipes").glob("*.yaml"))]
RECIPE = "recipes/gpt2-wikitext2.yaml"
# A synopsis word -> a value its option takes (the placeholder stands for any such value).
PLACEHOLDERS = {
    "N": "2", "K": "2", "E": "2", "G": "2", "M": "2", "T": "0.7", "P": "0.9", "SIZE": "8GiB", "NAME": "T4",
    "REPO": "user/model", "FILE": "README.md",  # --prompts-file must exist
    "RECIPE": RECIPE, "RECIPE.yaml": RECIPE, "OUT/config.yaml": RECIPE, "key=value": "train.lr=3e-5",
    "peft.method=M": "peft.method=lora", "KEY=V1,V2,…": "train.lr=1e-4,3e-4",
    "KEY=DIST:LOW:HIGH": "train.lr=loguniform:1e-5:1e-3", "GB/s": "100",
}
ELLIPSIS = ("…", "...")  # after an option that takes a value: a value; elsewhere "and more of these"
SHELL_SEPARATORS = re.compile(r"&&|;|(?<!\\)\|")  # a pipe ends a command; `\|` is a table's escaped "or"
COMMAND_WORD = re.compile(r"(^|[\s/])shardtune\s")
SPAN = re.compile(r"`([^`]+)`")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def _commands_in(text: str) -> list[list[str]]:
    """The words after `shardtune` (`.venv/bin/shardtune`, `-m shardtune`) of each command in `text`."""
    found = []
    for segment in SHELL_SEPARATORS.split(text):
        if not COMMAND_WORD.search(segment):  # prose or YAML in a fence: not for shlex
            continue
        words = shlex.split(segment.replace("\\|", " "))  # `a \| b`: either, so both are checked
        at = next((i for i, w in enumerate(words) if w == "shardtune" or w.endswith("/shardtune")), None)
        if at is not None and len(words) > at + 1:
            found.append(words[at + 1:])
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every command line shown: fenced blocks (`\\` continues a line), inline code
    that starts with `shardtune` and is more than a command's name, and the recipes' comments."""
    out = []
    for source in SOURCES:
        lines = source.read_text().splitlines()
        recipe = source.suffix == ".yaml"
        if recipe:
            lines = [line.strip()[1:] if line.lstrip().startswith("#") else "" for line in lines]
        fenced, held, since = False, "", 0
        for n, line in enumerate(lines):
            if line.startswith("```"):
                fenced, lines[n] = not fenced, ""
            elif fenced or (recipe and line.strip().startswith("shardtune ")):
                held, since, lines[n] = held + line.removesuffix("\\") + " ", since or n + 1, ""
                if not line.endswith("\\"):
                    out += [(f"{source.name}:{since}", words) for words in _commands_in(held)]
                    held, since = "", 0
        prose = "\n".join(lines)  # fences blanked, line numbers kept; a span may cross a line break
        for m in SPAN.finditer(prose):
            if m.group(1).split()[0].endswith("shardtune") and len(m.group(1).split()) > 2:
                where = f"{source.name}:{prose.count(chr(10), 0, m.start()) + 1}"
                out += [(where, words) for words in _commands_in(m.group(1))]
    return out


COMMANDS = documented_commands()


@functools.cache  # parsing leaves a parser as it was
def subparsers() -> dict[str, argparse.ArgumentParser]:
    from shardtune.cli.main import build_parser

    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def argv_of(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A documented command as an argv: synopsis brackets off, placeholders replaced."""
    argv = []
    for word in words:
        word = word.lstrip("[(")
        while word[-1:] in "])" and word.count(word[-1]) > word.count("[" if word[-1] == "]" else "("):
            word = word[:-1]  # a synopsis's closing bracket, not one of a value like [0.9,0.95]
        if word in ELLIPSIS:
            action = parser._option_string_actions.get(argv[-1]) if argv else None
            if action is None or action.nargs == 0:
                continue  # "more of the same"
            word = action.choices[0] if action.choices else "x"
        argv.append(PLACEHOLDERS.get(word, word))
    return argv


def check_config(args) -> None:
    """What a command that takes a recipe and overrides reads first: its config, and for a sweep
    every grid value and every value a search space checks."""
    from shardtune.cli.common import recipe_and_defaults
    from shardtune.config.load import load_config
    from shardtune.sweep.grid import parse_grid
    from shardtune.sweep.space import parse_space

    recipe, overrides, defaults, _ = recipe_and_defaults(args.recipe, args.overrides)
    points = [f"{key}={value}" for key, values in parse_grid(getattr(args, "grid", [])) for value in values]
    points += [f"{p.key}={value}" for p in parse_space(getattr(args, "search", [])) for value in p.checked()]
    for point in [None, *points]:
        load_config(recipe, overrides + ([point] if point else []), defaults)


def test_the_readme_shows_every_command():
    """Also what keeps the extraction honest: it finds every command, the recipes' included."""
    shown = {words[0] for where, words in COMMANDS if where.startswith("README")}
    assert shown == set(subparsers()), shown ^ set(subparsers())
    assert {where.split(":")[0] for where, _ in COMMANDS} >= {"README.md", "gpt2-wikitext2.yaml"}


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_documented_command_line_parses_and_loads(where, words, monkeypatch, capsys):
    from shardtune.cli.main import COMMANDS as NAMES
    from shardtune.cli.main import main
    from shardtune.hardware import gpu_by_name

    monkeypatch.chdir(ROOT)  # the README's paths are the repository's
    # the quickstart's corpus and tokenizer are built only when a run uses them
    monkeypatch.setattr("shardtune.data.quickstart.cached_assets",
                        lambda: {"tokenizer": "quickstart/tokenizer.json", "train": "quickstart/train.jsonl"})
    ran = []
    for name in NAMES:
        monkeypatch.setattr(f"shardtune.cli.{name}.run", lambda args: ran.append(args) or 0)
    argv = argv_of(words, subparsers()[words[0]])
    assert main(argv) == 0, f"{where}: shardtune {shlex.join(argv)}: {capsys.readouterr().err.strip()}"
    for args in ran:
        if hasattr(args, "overrides"):
            check_config(args)
        if getattr(args, "gpu", None):  # plan's names are checked by the run, not the parser
            gpu_by_name(args.gpu)


def test_the_commands_table_names_every_option_of_every_command():
    """The Commands table is each command's whole synopsis: an option `--help` lists (by any of its
    names) is in one of its command's rows, so a new option cannot stay undocumented."""
    rows = re.findall(r"^\| `shardtune (\w+) (.*?)` \|", (ROOT / "README.md").read_text(), re.M)
    named: dict[str, set[str]] = {}
    for command, synopsis in rows:
        words = (w.strip("[]()") for w in synopsis.split())
        named.setdefault(command, set()).update(w for w in words if w.startswith("-"))
    assert set(named) == set(subparsers()), set(named) ^ set(subparsers())
    missing = [f"{command}: {'/'.join(action.option_strings)}" for command, parser in subparsers().items()
               for action in parser._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction)
               and not set(action.option_strings) & named[command]]
    assert not missing, f"options missing from README's Commands table: {missing}"


def test_a_synopsis_value_in_brackets_is_the_default():
    """`[--max-shard-size 2GB]` says what leaving the option out means."""
    shown = []
    for where, words in COMMANDS:
        for at, (option, value) in enumerate(itertools.pairwise(words)):
            literal = value.rstrip("]")
            if option.startswith("[--") and value.endswith("]") and not re.fullmatch(r"[A-Z][A-Z_]*", literal) \
                    and literal not in (*ELLIPSIS, *PLACEHOLDERS):
                parser = subparsers()[words[0]]
                argv = argv_of(words, parser)
                given, _ = parser.parse_known_args(argv[1:])
                argv = argv_of(words[:at] + words[at + 2:], parser)
                left_out, _ = parser.parse_known_args(argv[1:])
                dest = parser._option_string_actions[option[1:]].dest
                assert getattr(given, dest) == getattr(left_out, dest), f"{where}: {option} {value}"
                shown.append(option.lstrip("["))
    assert len(shown) >= 4, shown


def prose_spans():
    """(file name, text) of each inline code span outside the fenced blocks."""
    for source in SOURCES:
        for span in SPAN.findall(FENCED.sub("", source.read_text())):
            yield source.name, span.replace("\\|", "|")


def test_every_option_named_in_prose_exists():
    """`--signal-lead`, `--format text`: an inline span that starts with an option names one of some
    command's options (and, where it has choices, one of them)."""
    options = {}
    for parser in subparsers().values():
        options.update(parser._option_string_actions)
    named = []
    for name, span in prose_spans():
        option, *value = span.split()
        if option.startswith("--"):
            assert option in options, f"{name}: `{span}`: no command has {option}"
            choices = options[option].choices
            assert not (choices and value) or value[0] in choices, f"{name}: `{span}`: not one of {choices}"
            named.append(option)
    assert len(named) >= 30, named


def config_type(key: str):
    """The schema's type of a dotted config key (KeyError: no such key); under a mapping
    (model.config.n_layer) the mapping's."""
    import dataclasses
    import typing

    from shardtune.config.schema import RunConfig

    tp = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            break
        tp = typing.get_type_hints(tp)[getattr(tp, "KEY_ALIASES", {}).get(part, part)]
    return tp


def test_every_config_key_named_in_prose_exists():
    """`fsdp.wrap=size`, `train.optimizer_state=fp32|bf16|8bit|4bit`: a `key=value` in inline code whose
    first part is a config key or section is a config key, and each `|` alternative one of its choices.
    (Other values are placeholders or grid values: the command lines above load the real ones.)"""
    import dataclasses
    import typing

    from shardtune.config.schema import RunConfig

    heads = {f.name for f in dataclasses.fields(RunConfig)}
    named = []
    for name, span in prose_spans():
        for key, value in re.findall(r"(?:^|\s)([a-z][\w.]*)=(\S*)", span):
            if key.split(".")[0] in heads:
                try:
                    tp = config_type(key)
                except KeyError:
                    pytest.fail(f"{name}: `{span}`: {key} is not a config key")
                if "|" in value:
                    wrong = set(value.split("|")) - set(typing.get_args(tp))
                    assert not wrong, f"{name}: `{span}`: {wrong} not among {key}'s choices {typing.get_args(tp)}"
                named.append(key)
    assert len(named) >= 50, named


# The README's forms of a config default: `key=value` (default) | `key` (default value | `key=x`, default
# value | default (`key=value` | a peft table row's `key` (value) | the reference block's (default value).
DEFAULT_CLAIMS = re.compile(r"`(?P<key>[a-z_.]+)(?:=(?P<value>[^`]+))?`(?: \(|, )default(?: (?P<stated>[\w.]+))?"
                            r"|default \(`(?P<key2>[a-z_.]+)=(?P<value2>[^`]+)`"
                            r"|^(?P<key3>[a-z_.]+) \(.* = None\)  .*\(default (?P<stated3>\w+)\)$", re.M)
PEFT_ROW = re.compile(r"^\| `(?:lora|dora|ia3|adaption_prompt|prompt_tuning|prefix_tuning)` \|.*$", re.M)
FILLED_IN = {"peft.num_virtual_tokens": "DEFAULT_VIRTUAL_TOKENS", "peft.adapter_len": "DEFAULT_ADAPTER_LEN"}


def default_of(key: str):
    """A config key's default; a None that the code fills in, as the value it fills in."""
    from functools import reduce

    from shardtune.config.schema import PeftConfig, RunConfig

    value = reduce(getattr, key.split("."), RunConfig())
    return getattr(PeftConfig, FILLED_IN[key]) if value is None and key in FILLED_IN else value


def test_the_config_defaults_the_readme_states_are_the_schemas():
    readme = (ROOT / "README.md").read_text()
    claims = [(m["key"] or m["key2"] or m["key3"], m["stated"] or m["value"] or m["value2"] or m["stated3"])
              for m in DEFAULT_CLAIMS.finditer(readme)]
    claims += [(f"peft.{key}", value) for row in PEFT_ROW.findall(readme)
               for key, value in re.findall(r"`(\w+)` \(([^)]+)\)", row.split("|")[3])]
    checked = []
    for key, stated in claims:
        try:
            default = default_of(key)
        except AttributeError:
            pytest.fail(f"README states a default for {key!r}, which is not a config key")
        if stated is None or default is None:  # nothing stated, or a default the run computes (output_dir)
            continue
        assert yaml.safe_load(stated) == default, f"README: {key} defaults to {stated}; the schema says {default!r}"
        checked.append(key)
    assert len(checked) >= 10, checked


def test_the_gpu_names_the_readme_lists_are_the_table():
    from shardtune.hardware import GPUS

    listed = re.search(r"`--gpu` names: (.*?) \(`--gpu-mem`", (ROOT / "README.md").read_text(), re.S)
    assert listed, "README's list of `--gpu` names is gone"
    names, table = [name.strip() for name in listed[1].split(",")], [gpu.name for gpu in GPUS]
    assert names == table, f"README lists {set(names) - set(table) or 'none'} not in hardware.GPUS, lacks " \
                           f"{set(table) - set(names) or 'none'} (or the order differs)"


def test_what_a_run_writes_lists_every_name_a_run_owns():
    """The files and folders the code counts as a run's (what --overwrite removes, resume=auto moves
    aside, a run folder is recognised by) are each a bullet of "What a run writes"."""
    from shardtune.checkpoint import rundir
    from shardtune.fsio import RUN_DIRS, RUN_MARKS

    section = re.search(r"^## What a run writes\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M)
    assert section, "README's 'What a run writes' section is gone"
    listed = {name.rstrip("/") for name in re.findall(r"^- ([^—]*?) — ", section[1], re.M)
              for name in re.findall(r"`([^`]+)`", name)}
    owned = {*RUN_MARKS, *RUN_DIRS, *rundir.RUN_FILES, *rundir.RUN_OUTPUTS, rundir.LOCK_FILE, rundir.EARLIER + "N"}
    assert owned <= listed, f"not in README's 'What a run writes': {sorted(owned - listed)}"


def test_the_split_prefixes_the_readme_states_are_the_readers():
    """A folder's file named `values.jsonl` is held out as validation data: the README says which
    prefixes make a split, so that list is the code's, and its examples land where it says."""
    from pathlib import Path

    from shardtune.data.files import VAL_NAMES, split_of

    said = re.search(r"names start \(in any case\) with\s+`train`, (\S+) or `test` become the splits \(so "
                     r"`(\w+\.\w+)` or\s+`(\w+\.\w+)` is validation", (ROOT / "README.md").read_text())
    assert said, "README's sentence on a folder's split prefixes is gone"
    assert said[1].replace("`", "").split("/") == list(VAL_NAMES)
    for name, split in [(said[2], "validation"), (said[3], "validation"), ("alpaca_test.jsonl", "test"),
                        ("wiki.valid.jsonl", "validation"), ("data-eval-00.parquet", "test")]:
        assert split_of(Path(name)) == split, name


def _resolves(parts: list[str]) -> bool:
    """Whether shardtune.<parts> is a module, or attributes of the longest module prefix."""
    import importlib

    for at in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("shardtune." + ".".join(parts[:at]))
        except ModuleNotFoundError:
            continue
        for part in parts[at:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_the_code_the_readme_names_exists():
    """`plan/keys.py`, `bench/plan_accuracy.py`, `hardware.CUDA_OVERHEADS`, `train.optim.decays`: a file,
    folder or module attribute named in inline code is there (a rename or move left the README
    pointing at nothing: `shardtune/model_configs/`). Placeholders (OUT/, RUN/) and config keys aside."""
    import dataclasses

    from shardtune.config.schema import RunConfig

    package = ROOT / "src" / "shardtune"
    tops = {p.name for p in ROOT.iterdir()} | {p.stem for p in package.iterdir()} | {"shardtune"}
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    missing, checked = [], 0
    for name, span in prose_spans():
        span = span.rstrip(",.;:")
        first = span.split("/")[0].split(".")[0]
        if name != "README.md" or first not in tops or first in sections or not re.fullmatch(r"[\w./-]+", span) \
                or re.search(r"\.(ya?ml|json|safetensors)$", span):  # a run's files (config.yaml)
            continue
        if "/" in span or re.search(r"\.(py|md|txt|toml|sh)$", span):
            found = any((root / span).exists() for root in (ROOT, package, ROOT / "src"))
        else:  # module.attribute, the module under shardtune
            found = _resolves(span.removeprefix("shardtune.").split("."))
        checked += 1
        if not found:
            missing.append(span)
    assert not missing, f"README names code that is not there: {missing}"
    assert checked >= 30, checked


def test_the_layout_table_names_every_module():
    """README's Layout row of each package names each of its modules (`name`: what it does), and
    only modules that are there; a module added without a row went unseen (weights_fit, resume)."""
    section = re.search(r"^## Layout\n(.*?)(?:^## |\Z)", (ROOT / "README.md").read_text(), re.S | re.M)
    assert section, "README's Layout section is gone"
    rows = dict(re.findall(r"^\| `(\w+)/` \| (.*) \|$", section[1], re.M))
    package = ROOT / "src" / "shardtune"
    packages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert set(rows) == packages, set(rows) ^ packages
    for name, concern in rows.items():
        if name == "cli":  # "one module per command"
            continue
        modules = {p.stem for p in (package / name).glob("*.py")} - {"__init__"}
        named = set(re.findall(r"(?:^|; |: )`(\w+)`: ", concern))
        assert modules <= named, f"Layout's {name}/ row lacks {sorted(modules - named)}"
        assert named <= modules, f"Layout's {name}/ row names {sorted(named - modules)}, not modules of {name}/"
