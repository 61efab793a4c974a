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
import sys
from collections.abc import Callable, Iterator

_MISSING = object()
# (owner, attribute) -> the value before the first patch; owner: a module or a class defined in it
_ORIGINALS: dict[tuple[object, str], object] = {}


def _owners() -> list[object]:
    """transformers' loaded modeling modules and the classes they define."""
    owners: list[object] = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("transformers.models."):
            continue
        owners.append(module)
        owners += [value for value in vars(module).values()
                   if isinstance(value, type) and value.__module__ == name]
    return owners


def _snapshot() -> dict[tuple[object, str], object]:
    return {(owner, attr): value for owner in _owners() for attr, value in list(vars(owner).items())}


def recorded(apply: Callable[[], object]) -> object:
    """Run `apply` (a library's patching function) and remember what it changed in the modeling
    modules loaded before it ran; what `apply` returns. Applied twice, the first originals stay."""
    before = _snapshot()
    result = apply()
    after = _snapshot()
    loaded = {id(owner) for owner, _ in before}  # a module imported by `apply` has no "before"
    for key in before.keys() | after.keys():
        old, new = before.get(key, _MISSING), after.get(key, _MISSING)
        if new is not old and id(key[0]) in loaded:
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
