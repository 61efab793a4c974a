"""A hash of the code that makes cached data. `datasets` keys a map's cache by the map function's
code but missed what the chat labels call two levels down, and the packed token files were keyed
by a version bumped by hand: a fix to what they compute (a label that was wrong) left every cache
made before it in use."""

from __future__ import annotations

import inspect


def code_hash(*modules) -> str:
    """The hash of every function's code in `modules`, their own classes' methods included."""
    from datasets.fingerprint import Hasher

    codes = []
    for module in modules:
        for name, value in sorted(vars(module).items()):
            own = inspect.isclass(value) and value.__module__ == module.__name__
            if inspect.isfunction(value) and value.__module__ != module.__name__:
                continue  # imported from elsewhere: that module's own hash covers it
            codes += [(name, f.__code__) for f in (vars(value).values() if own else [value]) if inspect.isfunction(f)]
    return Hasher.hash(codes)
