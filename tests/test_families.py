"""The families table (shardtune/families.py): its lookups. Each entry's facts are checked
against a tiny model of the family in tests/test_architectures.py."""

from __future__ import annotations

from shardtune.families import FAMILIES, PACKED_POSITIONS, family, with_document_mask


def test_an_unknown_family_has_no_facts():
    assert family("mamba") is None and family(None) is None


def test_document_mask_list_is_the_table_s_and_the_packed_positions_types():
    assert with_document_mask() == sorted({t for t, f in FAMILIES.items() if f.document_mask is not None}
                                          | PACKED_POSITIONS)
    assert not PACKED_POSITIONS & set(FAMILIES)  # a table row says it in its own entry
    assert "llama" in with_document_mask() and "bloom" not in with_document_mask()
