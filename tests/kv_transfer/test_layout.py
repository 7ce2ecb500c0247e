"""Layout math against the contract in docs/architecture.md, checked on a real tensor of that shape."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.errors import CompatibilityError
from kv_transfer.layout import KVLayout, PageRun, check_compatible, compat_hash, copy_spans, page_runs

LAYOUT = KVLayout(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8)


def test_block_offset_matches_the_tensor_layout() -> None:
    pool = np.arange(LAYOUT.pool_bytes // 4, dtype=np.float32).reshape(3, 2, 5, 4, 2, 8)
    for layer, kv, page in [(0, 0, 0), (1, 1, 3), (2, 0, 4), (2, 1, 4)]:
        offset = LAYOUT.block_offset_bytes(layer, kv, page)
        assert pool.reshape(-1).view(np.uint8)[offset:offset + LAYOUT.block_bytes].tobytes() \
            == pool[layer, kv, page].tobytes()


def test_sizes_and_slot_index() -> None:
    assert LAYOUT.block_bytes == 4 * 2 * 8 * 4
    assert LAYOUT.pool_bytes == 3 * 2 * 5 * LAYOUT.block_bytes
    assert LAYOUT.slot_index([3, 1], 5) == 1 * 4 + 1
    assert [LAYOUT.num_pages_for(n) for n in (1, 4, 5)] == [1, 1, 2]


def test_page_runs_merge_only_runs_contiguous_on_both_sides() -> None:
    assert page_runs([1, 2, 3, 7], [0, 1, 2, 3]) == [PageRun(1, 0, 3), PageRun(7, 3, 1)]
    assert page_runs([1, 2], [5, 4]) == [PageRun(1, 5, 1), PageRun(2, 4, 1)]
    with pytest.raises(ValueError):
        page_runs([1], [1, 2])


def test_copy_spans_move_exactly_the_mapped_pages_between_differently_sized_pools() -> None:
    dst_layout = KVLayout(num_layers=3, num_pages=7, page_size=4, num_kv_heads=2, head_dim=8)
    src = np.random.default_rng(0).random((3, 2, 5, 4, 2, 8), dtype=np.float32)
    dst = np.zeros((3, 2, 7, 4, 2, 8), dtype=np.float32)
    spans = copy_spans(LAYOUT, dst_layout, page_runs([0, 3, 4], [6, 2, 3]))
    src_bytes, dst_bytes = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    for s, d, n in spans.tolist():
        dst_bytes[d:d + n] = src_bytes[s:s + n]
    assert np.array_equal(dst[:, :, 6], src[:, :, 0]) and np.array_equal(dst[:, :, 2:4], src[:, :, [3, 4]])
    assert not dst[:, :, [0, 1, 4, 5]].any()
    assert len(spans) == 3 * 2 * 2


def test_compatibility_names_the_first_differing_field() -> None:
    check_compatible("m", LAYOUT, "m", KVLayout(3, 99, 4, 2, 8))  # num_pages may differ
    for field, other in [("head_dim", KVLayout(3, 5, 4, 2, 16)), ("page_size", KVLayout(3, 5, 8, 2, 8)),
                         ("num_layers", KVLayout(4, 5, 4, 2, 8)), ("num_kv_heads", KVLayout(3, 5, 4, 1, 8)),
                         ("dtype", KVLayout(3, 5, 4, 2, 8, "float16")), ("version", KVLayout(3, 5, 4, 2, 8, version=2))]:
        with pytest.raises(CompatibilityError) as info:
            check_compatible("m", LAYOUT, "m", other)
        assert info.value.field == field and field in str(info.value)
        assert compat_hash("m", LAYOUT) != compat_hash("m", other)
    with pytest.raises(CompatibilityError, match="model_id"):
        check_compatible("m", LAYOUT, "other", LAYOUT)


def test_layout_validates_its_fields() -> None:
    with pytest.raises(ValueError):
        KVLayout(0, 5, 4, 2, 8)
    with pytest.raises(ValueError):
        KVLayout(3, 5, 4, 2, 8, "int3")
    assert KVLayout.from_json(LAYOUT.to_json()) == LAYOUT
