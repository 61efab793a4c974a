"""Process-wide patches of transformers' modeling modules (Liger-Kernel's), recorded so that code
which builds a fresh model of a patched family to count or trace it can do so with the library's
own modules.

Liger-Kernel patches a model instance and also swaps its family's classes and functions in the
modeling module (`modeling_llama.LlamaRMSNorm = LigerRMSNorm`, the rotary function), so every model
of that family built later in the process runs Triton kernels. A forward on meta tensors (the FLOP
count of telemetry/flops.py) hands those kernels null pointers: on a GPU, an illegal memory access
that poisons the CUDA context, reported at the next CUDA call (H200, 2026-11-26: every
kernels=liger run stopped before its first step). `originals()` puts the modules as they were
around such code."""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Callable, Iterator

_MISSING = object()
# (owner, attribute) -> the value before the first patch; owner: a module or a class defined in it
_ORIGINALS: dict[tuple[object, str], object] = {}


def _owners() -> list[object]:
    """transformers' loaded modeling modules and the classes they define, and those a recorded patch
    took out of a module's namespace (the patch after it may change them too)."""
    owners: list[object] = []
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("transformers.models."):
            owners += _defined(module)
    owners += [owner for owner, _ in _ORIGINALS] + [value for value in _ORIGINALS.values() if isinstance(value, type)]
    return list({id(owner): owner for owner in owners}.values())


def _defined(module) -> list[object]:
    """`module` and the classes defined in it."""
    return [module] + [value for value in vars(module).values()
                       if isinstance(value, type) and value.__module__ == module.__name__]


def _snapshot(owners: list[object]) -> dict[tuple[object, str], object]:
    return {(owner, attr): value for owner in owners for attr, value in list(vars(owner).items())}


class _Imports(importlib.abc.MetaPathFinder):
    """While a patch runs: each modeling module it imports, as its code left it (before the patch
    changed it), so that one has a "before" too (Liger imports the modules it patches)."""

    def __init__(self) -> None:
        self.before: dict[tuple[object, str], object] = {}
        self.loaders: list[object] = []

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("transformers.models."):
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") \
                else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if hasattr(loader, "exec_module") and not isinstance(loader, type) and "exec_module" not in vars(loader):
            run = loader.exec_module

            def exec_module(module):
                run(module)
                self.before.update(_snapshot(_defined(sys.modules.get(module.__name__, module))))

            loader.exec_module = exec_module  # this loader's only, until the patch returns
            self.loaders.append(loader)
        return spec

    def __enter__(self) -> _Imports:
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc) -> None:
        sys.meta_path.remove(self)
        for loader in self.loaders:
            vars(loader).pop("exec_module", None)


def recorded(apply: Callable[[], object]) -> object:
    """Run `apply` (a library's patching function) and remember what it changed in the modeling
    modules, those loaded before it ran and those it imported; what `apply` returns. Applied
    twice, the first originals stay. A class `apply` took out of its module is compared as it
    was: its own attributes did not change (recorded as changed, a root class's `__dict__` was
    set back, which Python refuses)."""
    owners = _owners()
    before = _snapshot(owners)
    with _Imports() as imports:
        result = apply()
    before.update(imports.before)
    after = _snapshot(owners + list({id(owner): owner for owner, _ in imports.before}.values()))
    for key in before.keys() | after.keys():
        old, new = before.get(key, _MISSING), after.get(key, _MISSING)
        if new is not old:
            _ORIGINALS.setdefault(key, old)
    return result


@contextlib.contextmanager
def originals() -> Iterator[None]:
    """The recorded attributes as they were before any patch, until the block ends (then patched again)."""
    current = {key: vars(key[0]).get(key[1], _MISSING) for key in _ORIGINALS}
    try:
        for key, value in _ORIGINALS.items():
            _put(*key, value)
        yield
    finally:
        for key, value in current.items():
            _put(*key, value)


def _put(owner: object, attr: str, value: object) -> None:
    if value is _MISSING:
        if attr in vars(owner):
            delattr(owner, attr)
    else:
        setattr(owner, attr, value)
