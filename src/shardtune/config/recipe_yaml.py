"""Reading YAML that a user wrote (recipes, `key=value` override values) strictly: a key given
twice is refused (plain YAML silently keeps the last), a syntax error names its line and
column, and anchors/aliases may not expand into more than MAX_NODES nodes (an "alias bomb" of a
few lines would otherwise expand to gigabytes when the config is printed or saved)."""

from __future__ import annotations

import re

import yaml

from shardtune.errors import UserError, first_line

MAX_NODES = 100_000  # far above any recipe (the whole schema is ~100 keys), far below a bomb


class Written(str):
    """A value YAML read from text, with that text: a key typed as text (`config.load`) takes the
    text, any other key the value YAML read (`.parsed`)."""

    def __new__(cls, raw: str, parsed):
        obj = super().__new__(cls, raw)
        obj.parsed = parsed
        return obj

    def __getnewargs__(self):  # copy.deepcopy and pickle make it again from both
        return str(self), self.parsed

    def __repr__(self) -> str:  # a number as a number in messages; a list/mapping override as its text
        return str.__repr__(self) if isinstance(self.parsed, (list, dict)) else repr(self.parsed)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and over-large alias expansions, and keeps
    the text of a plain number or date (`Written`): YAML 1.1 reads `output_dir: 007` as 7 and
    `publish.revision: 1.10` as 1.1, which a key typed as text turned into '7' and '1.1'."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except UnreadableValue:
            raise
        except (LookupError, AttributeError, TypeError, ValueError) as exc:  # not RecursionError: no stack left
            # an explicit tag on text that is no such value (`!!bool 2`, `!!timestamp x`, `!!int x`): PyYAML's
            # constructor raised a bare KeyError or AttributeError, which no caller knew as the YAML's fault
            shown = f" {node.value[:40]!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise UnreadableValue(f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}: the "
                                  f"{node.tag.rsplit(':', 1)[-1]} value{shown} ({type(exc).__name__}: "
                                  f"{first_line(exc, 80)})") from None

    def construct_document(self, node):
        _check_expanded_size(node)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = _parsed(self.construct_object(key_node, deep=True))
                try:
                    earlier = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error tells it
                    continue
                if earlier is not None:
                    raise UserError(f"key {key!r} is given twice (lines {earlier} and {key_node.start_mark.line + 1}); "
                                    "keep one of them")
                seen[key] = key_node.start_mark.line + 1
        mapping = super().construct_mapping(node, deep=deep)
        return {_parsed(k): v for k, v in mapping.items()}  # a key is what YAML read (`1:` an int)


def _written(construct):
    def construct_written(loader, node):
        value = construct(loader, node)
        return Written(node.value, value) if node.style is None else value  # plain (not quoted, not tagged)

    return construct_written


for _tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"):
    StrictLoader.add_constructor(_tag, _written(StrictLoader.yaml_constructors[_tag]))


def _parsed(value):
    return value.parsed if isinstance(value, Written) else value


# A number with an exponent (1e-06, 1.5e3: as JSON and Python write floats) is a float, as in YAML
# 1.2; PyYAML's YAML 1.1 wants a dot and a signed exponent, reads the rest as text, and a free
# mapping (model.config) kept it so.
class Dumper(yaml.SafeDumper):
    """Writes what StrictLoader reads back the same: the text "1e5" quoted (plain, it would read as a float)."""


for _cls in (StrictLoader, Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float",
                               re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"), list("-+.0123456789"))


def _check_expanded_size(root) -> None:
    """Nodes the document has once every alias is expanded, counted without expanding them."""
    sizes: dict[int, int | None] = {}

    def size(node) -> int:
        if id(node) in sizes:
            if sizes[id(node)] is None:
                raise UserError(f"an alias at line {node.start_mark.line + 1} refers to a value that contains "
                                "it (a value inside itself); write the values out")
            return sizes[id(node)]
        sizes[id(node)] = None  # in progress
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1 + sum(size(child) for child in children)
        sizes[id(node)] = min(total, MAX_NODES + 1)
        return sizes[id(node)]

    if size(root) > MAX_NODES:
        raise UserError(f"the YAML expands to more than {MAX_NODES} values through its anchors and aliases "
                        "(an alias bomb?); write the values out")


def where(exc: yaml.YAMLError) -> str:
    """`line L, column C: problem` of a YAML syntax error (its first line alone names no place)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


class UnreadableValue(ValueError):
    """A value whose text YAML read but could not make into its type, with its place."""


class YAMLSyntaxError(UserError):
    """Text that is not YAML at all (an override value may then be meant as plain text)."""


def load_yaml(text: str, what: str, fix: str = "fix it"):
    """The YAML `text` as Python values; every problem is one UserError naming `what`."""
    try:
        return yaml.load(text, Loader=StrictLoader)
    except UserError as exc:
        raise UserError(f"{what}: {exc}") from None
    except yaml.YAMLError as exc:
        raise YAMLSyntaxError(f"{what} is not valid YAML ({where(exc)}); {fix}") from None
    except UnreadableValue as exc:  # e.g. an int of more digits than Python converts
        raise UserError(f"{what} holds a value YAML cannot read ({exc}); {fix}") from None
    except (ValueError, RecursionError, LookupError, AttributeError, TypeError) as exc:  # nesting too deep
        raise UserError(f"{what} holds a value YAML cannot read ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); {fix}") from None
