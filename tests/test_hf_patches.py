"""hf_patches: what a library's patching function changes in transformers' loaded modeling modules
(a module's attributes, a class's) is put back inside `originals()` and patched again after it;
patched twice, the first originals stay; an attribute the patch added is absent inside; a random
set of such patches, applied up to three times, on a made-up family (the property test)."""

from __future__ import annotations

import importlib
import itertools
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gpt2 import modeling_gpt2

from shardtune import hf_patches


def test_originals_inside_the_block_patches_after_it(monkeypatch):
    for owner in (modeling_gpt2, modeling_gpt2.GPT2MLP):
        for name, value in list(vars(owner).items()):
            monkeypatch.setattr(owner, name, value)
    monkeypatch.setattr(hf_patches, "_ORIGINALS", {})
    block, forward = modeling_gpt2.GPT2Block, modeling_gpt2.GPT2MLP.forward

    class Patched(block):
        pass

    def patch(first=True):
        modeling_gpt2.GPT2Block = Patched if first else type("Again", (Patched,), {})
        modeling_gpt2.GPT2MLP.forward = lambda self, x: x
        modeling_gpt2.added_by_the_patch = True
        return "returned"

    assert hf_patches.recorded(patch) == "returned"
    hf_patches.recorded(lambda: patch(first=False))
    patched = (modeling_gpt2.GPT2Block, modeling_gpt2.GPT2MLP.forward)
    with hf_patches.originals():
        assert modeling_gpt2.GPT2Block is block and modeling_gpt2.GPT2MLP.forward is forward
        assert not hasattr(modeling_gpt2, "added_by_the_patch")
    assert (modeling_gpt2.GPT2Block, modeling_gpt2.GPT2MLP.forward) == patched
    assert modeling_gpt2.added_by_the_patch
    del modeling_gpt2.added_by_the_patch


def test_nothing_recorded_nothing_changed():
    before = dict(vars(modeling_gpt2))
    hf_patches.recorded(lambda: None)
    with hf_patches.originals():
        assert dict(vars(modeling_gpt2)) == before


_FRESH = itertools.count()
# a, b: module values and class attributes; f, g: C's methods (D inherits them); new: added by a patch;
# C, D: the module's classes, swapped or removed as Liger swaps a family's RMSNorm class
ATTRS = ["a", "b", "f", "g", "new", "C", "D"]
LATE = "X = 1\n\n\nclass K:\n    def m(self):\n        return 1\n"  # a modeling module first imported by a patch


@pytest.fixture(scope="module")
def late_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("late")
    (folder / "modeling_late.py").write_text(LATE)
    return folder


def family(folder) -> tuple[str, list]:
    """A fresh made-up family: its package (whose modeling_late only a patch imports) and its
    modeling module with a class and a subclass defined there."""
    package = f"transformers.models._shardtune_test_{next(_FRESH)}"
    name = f"{package}.modeling"
    module, pkg = types.ModuleType(name), types.ModuleType(package)
    pkg.__path__ = [str(folder)]
    base = type("C", (), {"__module__": name, "f": lambda self: 1, "g": lambda self: 2, "a": 1})
    sub = type("D", (base,), {"__module__": name, "b": 2})
    module.__dict__.update(a=object(), b=object(), C=base, D=sub)
    sys.modules.update({package: pkg, name: module})
    return package, [pkg, module, base, sub]


def names(module) -> set[str]:
    return {name for name in vars(module) if not name.startswith("__")}


def state(owners) -> list[dict]:
    return [dict(vars(o)) for o in owners]


@pytest.fixture(scope="module")
def only_made_up_families():
    """Out of sys.modules meanwhile: the real modeling modules, which the patches here never touch.
    A suite's worker may have loaded all of transformers' (test_every_architecture.py), and each
    recorded() snapshots every loaded one: 20 s for this test instead of 0.4 s."""
    real = {name: module for name, module in sys.modules.items() if name.startswith("transformers.models.")}
    for name in real:
        del sys.modules[name]
    yield
    sys.modules.update(real)


OPS = st.lists(st.tuples(st.sampled_from(["set", "del"]), st.integers(1, 3), st.sampled_from(ATTRS)), max_size=8)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(OPS, st.booleans()), min_size=1, max_size=3))
def test_any_patches_any_number_of_times_are_undone_inside_and_redone_after(late_folder, only_made_up_families,
                                                                              rounds):
    """Inside originals(): every module and class loaded before the first patch exactly as it was
    (an attribute set, deleted or added by any of the patches; a class swapped out of its module and
    patched after), and a module a patch imported as its code left it."""
    saved = dict(hf_patches._ORIGINALS)
    hf_patches._ORIGINALS.clear()
    package, owners = family(late_folder)
    try:
        before = state(owners)
        for ops, imports in rounds:
            def patch(ops=ops, imports=imports):
                for op, i, attr in ops:
                    if op == "set":
                        setattr(owners[i], attr, object())
                    elif attr in vars(owners[i]):
                        delattr(owners[i], attr)
                if imports:
                    late = importlib.import_module(f"{package}.modeling_late")
                    late.X, late.K.m = object(), object()
            hf_patches.recorded(patch)
        late = sys.modules.get(f"{package}.modeling_late")
        pristine = types.ModuleType("pristine")
        exec(LATE, vars(pristine))
        patched = state(owners + ([late, late.K] if late else []))
        with hf_patches.originals():
            assert state(owners) == before
            if late:  # as its code left it
                assert late.X == 1 and late.K.m.__qualname__ == "K.m" and names(late) == names(pristine)
        assert state(owners + ([late, late.K] if late else [])) == patched
    finally:
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]
        hf_patches._ORIGINALS.clear()
        hf_patches._ORIGINALS.update(saved)
