"""hf_patches: what a library's patching function changes in transformers' loaded modeling modules
(a module's attributes, a class's) is put back inside `originals()` and patched again after it;
patched twice, the first originals stay; an attribute the patch added is absent inside."""

from __future__ import annotations

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
