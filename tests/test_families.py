"""The families table (shardtune/families.py): its lookups. Each entry's facts are checked
against a tiny model of the family in tests/test_architectures.py."""

from __future__ import annotations

from shardtune.families import FAMILIES, family, with_document_mask


def test_an_unknown_family_has_no_facts():
    assert family("mamba") is None and family(None) is None


def test_document_mask_list_is_the_table_s():
    assert with_document_mask() == sorted(t for t, f in FAMILIES.items() if f.document_mask is not None)
    assert "llama" in with_document_mask() and "bloom" not in with_document_mask()
