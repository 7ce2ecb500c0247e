"""Layout math against the contract in docs/architecture.md, checked on a real tensor of that shape."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kv_transfer.blocks import BlockTable, merge_runs
from kv_transfer.errors import CompatibilityError
from kv_transfer.layout import KVLayout, check_compatible, compat_hash, describe

LAYOUT = KVLayout(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8)


def test_block_offset_matches_the_tensor_layout() -> None:
    """Page-major, head-major inside a page: [num_pages, kv_heads, num_layers, 2, page_size, head_dim]; a
    page is one contiguous range, and so is each head of it."""
    pool = np.arange(LAYOUT.pool_bytes // 4, dtype=np.float32).reshape(5, 2, 3, 2, 4, 8)
    flat = pool.reshape(-1).view(np.uint8)
    for page, head, layer, kv in [(0, 0, 0, 0), (3, 1, 1, 1), (4, 0, 2, 0), (4, 1, 2, 1)]:
        offset = LAYOUT.block_offset_bytes(page, head, layer, kv)
        assert flat[offset:offset + LAYOUT.block_bytes].tobytes() == pool[page, head, layer, kv].tobytes()
    for page in range(5):
        offset = LAYOUT.page_offset_bytes(page)
        assert flat[offset:offset + LAYOUT.page_bytes].tobytes() == pool[page].tobytes()
        for head in range(2):
            start = offset + head * LAYOUT.page_head_bytes
            assert flat[start:start + LAYOUT.page_head_bytes].tobytes() == pool[page, head].tobytes()


def test_sizes_and_slot_index() -> None:
    assert LAYOUT.block_bytes == 4 * 8 * 4 and LAYOUT.page_head_bytes == 3 * 2 * LAYOUT.block_bytes
    assert LAYOUT.pool_bytes == 2 * 3 * 2 * 5 * LAYOUT.block_bytes == 5 * LAYOUT.page_bytes
    assert LAYOUT.slot_index([3, 1], 5) == 1 * 4 + 1
    assert [LAYOUT.num_pages_for(n) for n in (1, 4, 5)] == [1, 1, 2]


def test_block_table_indices_address_exactly_the_mapped_pages_between_differently_sized_pools() -> None:
    dst_layout = KVLayout(num_layers=3, num_pages=7, page_size=4, num_kv_heads=2, head_dim=8)
    src = np.random.default_rng(0).random((5, 3, 2, 4, 2, 8), dtype=np.float32)
    dst = np.zeros((7, 3, 2, 4, 2, 8), dtype=np.float32)
    aux_src, aux_dst = np.arange(64, dtype=np.uint8), np.zeros(2 * 32, dtype=np.uint8)
    src_table = BlockTable(src.ctypes.data, LAYOUT, aux_src.ctypes.data, 2)
    dst_table = BlockTable(dst.ctypes.data, dst_layout, aux_dst.ctypes.data, 2)
    local = np.append(src_table.kv_indices([0, 3, 4]), src_table.aux_index(1))
    remote = np.append(dst_table.kv_indices([6, 2, 3]), dst_table.aux_index(0))
    for (s, n), (d, m) in zip(src_table.spans(local).tolist(), dst_table.spans(remote).tolist()):
        assert n == m
        ctypes.memmove(d, s, n)
    assert np.array_equal(dst[6], src[0]) and np.array_equal(dst[2:4], src[[3, 4]])
    assert not dst[[0, 1, 4, 5]].any()
    assert np.array_equal(aux_dst[:32], aux_src[32:]) and not aux_dst[32:].any()
    assert len(src_table.descriptors(0, src_table.num_descriptors)) == 5 + 2   # one per page, one per slot
    with pytest.raises(ValueError):
        src_table.kv_indices([5])


def test_compatibility_names_the_first_differing_field() -> None:
    check_compatible("m", LAYOUT, "m", KVLayout(3, 99, 4, 2, 8))  # num_pages may differ
    for field, other in [("head_dim", KVLayout(3, 5, 4, 2, 16)), ("page_size", KVLayout(3, 5, 8, 2, 8)),
                         ("num_layers", KVLayout(4, 5, 4, 2, 8)), ("num_kv_heads", KVLayout(3, 5, 4, 1, 8)),
                         ("dtype", KVLayout(3, 5, 4, 2, 8, "float16")),
                         ("weight_quant", KVLayout(3, 5, 4, 2, 8, weight_quant="int8")),
                         ("version", KVLayout(3, 5, 4, 2, 8, version=1))]:
        with pytest.raises(CompatibilityError) as info:
            check_compatible("m", LAYOUT, "m", other)
        assert info.value.field == field and field in str(info.value)
        assert describe("m", LAYOUT) in str(info.value) and describe("m", other) in str(info.value)
        assert compat_hash("m", LAYOUT) != compat_hash("m", other)
    with pytest.raises(CompatibilityError, match="model_id"):
        check_compatible("m", LAYOUT, "other", LAYOUT)


def test_a_peer_registering_another_hash_is_incompatible_and_named() -> None:
    with pytest.raises(CompatibilityError) as info:
        check_compatible("m", LAYOUT, "m", LAYOUT, their_hash="0123456789abcdef")
    assert info.value.field == "compat_hash" and "0123456789abcdef" in str(info.value)
    assert compat_hash("m", LAYOUT) in str(info.value)
    check_compatible("m", LAYOUT, "m", LAYOUT, their_hash=compat_hash("m", LAYOUT))


def test_merge_runs_joins_pages_contiguous_on_both_sides_only() -> None:
    table = BlockTable(1 << 20, LAYOUT, 1 << 30, 4)
    src, dst = table.spans(table.kv_indices([0, 1, 2, 4])), table.spans(table.kv_indices([3, 4, 0, 1]))
    runs = merge_runs(src, dst)   # 0->3, 1->4 merge; 2->0 and 4->1 do not (4 does not follow 2 at the source)
    page = LAYOUT.page_bytes
    assert runs.nbytes.tolist() == [2 * page, page, page]
    assert runs.src_addrs.tolist() == [1 << 20, (1 << 20) + 2 * page, (1 << 20) + 4 * page]
    assert runs.dst_addrs.tolist() == [(1 << 20) + 3 * page, 1 << 20, (1 << 20) + page]
    with pytest.raises(ValueError):
        merge_runs(src, table.spans(np.array([table.aux_index(0)] * 4)))


def test_a_bf16_pool_halves_the_bytes_of_an_fp32_one_and_round_trips() -> None:
    bf16 = KVLayout(3, 5, 4, 2, 8, "bfloat16", weight_quant="int8")
    assert bf16.itemsize_bytes * 2 == LAYOUT.itemsize_bytes
    assert bf16.page_bytes * 2 == LAYOUT.page_bytes
    assert KVLayout.from_json(bf16.to_json()) == bf16


def test_layout_validates_its_fields() -> None:
    with pytest.raises(ValueError):
        KVLayout(0, 5, 4, 2, 8)
    with pytest.raises(ValueError):
        KVLayout(3, 5, 4, 2, 8, "int3")
    assert KVLayout.from_json(LAYOUT.to_json()) == LAYOUT


MLA = KVLayout(num_layers=3, num_pages=5, page_size=4, num_kv_heads=1, head_dim=24, kind="mla")


def test_an_mla_layout_is_one_latent_plane_per_layer_and_matches_its_tensor() -> None:
    """MLA: [num_pages, 1, num_layers, 1, page_size, latent_dim]: no V plane, a page is still one range."""
    assert MLA.num_planes == 1 and MLA.page_bytes == 3 * 4 * 24 * 4 and LAYOUT.num_planes == 2
    pool = np.arange(MLA.pool_bytes // 4, dtype=np.float32).reshape(5, 1, 3, 1, 4, 24)
    flat = pool.reshape(-1).view(np.uint8)
    for layer, page in [(0, 0), (2, 3), (1, 4)]:
        offset = MLA.block_offset_bytes(page, 0, layer, 0)
        assert flat[offset:offset + MLA.block_bytes].tobytes() == pool[page, 0, layer, 0].tobytes()
    table = BlockTable(1 << 20, MLA, 1 << 30, 1)
    spans = table.partial_page_spans(2, 3)   # one span per layer: the latent's first 3 slots
    assert spans.tolist() == [[(1 << 20) + 2 * MLA.page_bytes + layer * MLA.block_bytes, 3 * 24 * 4]
                              for layer in range(3)]


def test_layouts_of_another_kind_are_incompatible_by_name() -> None:
    """An MLA pool never pairs with an MHA pool, even one of the same bytes; the hash differs too."""
    same_bytes = KVLayout(num_layers=3, num_pages=5, page_size=4, num_kv_heads=1, head_dim=12)
    assert same_bytes.page_bytes == MLA.page_bytes
    with pytest.raises(CompatibilityError) as info:
        check_compatible("m", MLA, "m", same_bytes)
    assert info.value.field == "kind" and "kind=mla" in str(info.value)
    assert compat_hash("m", MLA) != compat_hash("m", KVLayout(3, 5, 4, 1, 24))
    with pytest.raises(ValueError, match="kind"):
        KVLayout(3, 5, 4, 1, 24, kind="gqa")


def test_a_dense_layout_keeps_its_hash_and_reads_a_peer_json_without_kind() -> None:
    """``kind`` enters neither the hash of an MHA layout (the hash is that of the fields without it) nor its
    JSON's required fields."""
    import hashlib
    import json

    old = {"model_id": "m", "version": LAYOUT.version, "dtype": "float32", "weight_quant": "none",
           "page_size": 4, "num_layers": 3, "num_kv_heads": 2, "head_dim": 8}
    before = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert compat_hash("m", LAYOUT) == before
    data = LAYOUT.to_json()
    del data["kind"]
    assert KVLayout.from_json(data) == LAYOUT and KVLayout.from_json(MLA.to_json()) == MLA


def test_a_peer_of_the_token_major_layout_version_2_is_refused_by_name() -> None:
    """Version 2 kept a token's heads innermost (``[pages, layers, 2, page_size, heads, head_dim]``): the same
    bytes in another order, so a version-2 peer would read every page scrambled."""
    assert LAYOUT.version == 3
    old = KVLayout(3, 5, 4, 2, 8, version=2)
    with pytest.raises(CompatibilityError) as info:
        check_compatible("m", LAYOUT, "m", old)
    assert info.value.field == "version"
