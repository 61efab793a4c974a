"""`sweep --search`'s space: a key's distribution as written on the command line (`Param`), read
(`parse_param`, `parse_space`) and checked against the key's declared type (`check_kind`)."""

from __future__ import annotations

import dataclasses
import math

from shardtune.errors import UserError
from shardtune.sweep.grid import split_values

DISTRIBUTIONS = ("loguniform", "uniform", "int", "logint", "choice")
CHECK_ALL = 64  # an int range of up to this many values has every one checked before trial 1 (~5 ms each)


@dataclasses.dataclass
class Param:
    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    choices: list[str] | None = None

    def suggest(self, trial):
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, self.choices)
        if self.kind in ("int", "logint"):
            return trial.suggest_int(self.key, self.low, self.high, log=self.kind == "logint")
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "loguniform")

    def checked(self) -> list[str]:
        """Values that must all load as a valid config before any trial runs: every choice, every whole
        number of a range of up to CHECK_ALL (int:1:4 of a micro-batch drew 3, which the global batch
        does not divide: a failed trial), else the bounds."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind in ("int", "logint") and self.high - self.low < CHECK_ALL:
            return [str(v) for v in range(self.low, self.high + 1)]
        return [repr(self.low), repr(self.high)]

    def spec(self) -> str:
        if self.kind == "choice":
            return f"choice:{','.join(self.choices)}"
        return f"{self.kind}:{self.low}:{self.high}"


def parse_param(text: str) -> Param:
    key, sep, raw = text.partition("=")
    key = key.strip()
    kind, _, rest = raw.partition(":")
    example = "--search train.lr=loguniform:1e-5:1e-3 (or uniform/int/logint:LOW:HIGH, choice:A,B,C)"
    if not sep or not key or kind not in DISTRIBUTIONS:
        raise UserError(f"--search {text!r}: " + (f"unknown distribution {kind!r}; " if sep and key and kind else "")
                        + f"write it like {example}")
    if kind == "choice":
        choices = split_values(rest)  # as the grid's: a list value in brackets is one choice ([0.9,0.95])
        if len(choices) < 2 or "" in choices or len(set(choices)) < len(choices):
            raise UserError(f"--search {text!r}: choice needs two or more different values, e.g. choice:8,16,32")
        return Param(key, kind, choices=choices)
    bounds = rest.split(":")
    number = int if kind in ("int", "logint") else float
    try:
        low, high = (number(b) for b in bounds) if len(bounds) == 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or not (math.isfinite(low) and math.isfinite(high)):
        raise UserError(f"--search {text!r}: {kind} needs two {number.__name__} bounds LOW:HIGH; write it like "
                        f"{example}")
    if low >= high:
        raise UserError(f"--search {text!r}: LOW must be below HIGH")
    if kind.startswith("log") and low <= 0:
        raise UserError(f"--search {text!r}: a log scale needs LOW > 0")
    return Param(key, kind, low, high)


def parse_space(texts: list[str]) -> list[Param]:
    space = [parse_param(t) for t in texts]
    keys = [p.key for p in space]
    for key in keys:
        if keys.count(key) > 1:
            raise UserError(f"--search {key} is given twice; give each key one distribution")
    return space


def check_kind(param: Param) -> None:
    """A distribution the key's declared type can take: numbers only for a number key, whole
    numbers only for an int key; a text key, a choice or a list is searched with choice:A,B."""
    from shardtune.config.schema import key_type, number_types

    tp = key_type(param.key)
    if tp is None or param.kind == "choice":
        return  # an unknown key: loading its values says so, with a suggestion; choices load as written
    numbers = number_types(tp)
    if not numbers:
        raise UserError(f"--search {param.key}={param.spec()}: {param.key} is not a number "
                        f"({str(tp).replace('typing.', '')}); search it with choice:A,B")
    if param.kind in ("uniform", "loguniform") and float not in numbers:
        raise UserError(f"--search {param.key}={param.spec()}: {param.key} is a whole number and {param.kind} "
                        f"draws fractions; use int:LOW:HIGH or logint:LOW:HIGH")
