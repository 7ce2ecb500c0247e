"""PageAllocator: exact accounting, refusals leave state unchanged, and KVPool layout math."""

import pytest
import torch

from engine.kv_pool import HUGE_PAGE_BYTES, KVPool, KVShape
from engine.page_allocator import PageAllocator


def test_allocate_and_free_restore_the_count():
    a = PageAllocator(8)
    pages = a.allocate(5)
    assert len(set(pages)) == 5 and a.num_free == 3
    a.free(pages)
    assert a.num_free == 8


def test_fresh_allocations_are_contiguous():
    assert PageAllocator(8).allocate(4) == [0, 1, 2, 3]


def test_allocate_more_than_free_raises_and_takes_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(ValueError):
        a.allocate(2)
    assert a.num_free == 1


def test_double_free_raises_and_frees_nothing():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(pages)
    assert a.num_free == 3


def test_page_listed_twice_is_a_double_free():
    a = PageAllocator(4)
    p = a.allocate(1)
    with pytest.raises(ValueError):
        a.free(p + p)
    assert a.num_free == 3


@pytest.mark.parametrize("page", [-1, 4, 100, "0"])
def test_foreign_page_raises(page):
    a = PageAllocator(4)
    a.allocate(4)
    with pytest.raises(ValueError):
        a.free([page])
    assert a.num_free == 0


def test_freed_pages_are_reused():
    a = PageAllocator(2)
    p = a.allocate(2)
    a.free(p)
    assert sorted(a.allocate(2)) == sorted(p)


def test_kv_pool_block_offset_matches_tensor_addresses():
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, page_size=16)
    pool = KVPool(shape, num_pages=5, dtype=torch.float32, device="cpu")
    assert pool.nbytes == 3 * 2 * 5 * 16 * 2 * 4 * 4
    assert pool.block_bytes == 16 * 4 * 4
    for layer, kv, page, head in [(0, 0, 0, 0), (1, 1, 3, 1), (2, 0, 4, 1)]:
        block = pool.kv_cache[layer, kv, page, :, head]   # [page_size, head_dim]: one contiguous block
        assert block.is_contiguous()
        assert pool.block_offset(page, head, layer, kv) == block.data_ptr() - pool.base_ptr
    assert torch.count_nonzero(pool.kv_cache) == 0
    with pytest.raises(IndexError):
        pool.block_offset(0, 0, 0, 2)
    with pytest.raises(IndexError):
        pool.block_offset(0, 2, 0, 0)


def test_kv_pool_is_page_major_one_page_is_one_contiguous_region():
    """Every (layer, kv) block of page p lies inside [p * page_bytes, (p + 1) * page_bytes): a page moves as
    one descriptor however scattered the pages are."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, page_size=16)
    pool = KVPool(shape, num_pages=5, dtype=torch.float32, device="cpu")
    assert pool.page_bytes == 2 * 2 * 3 * pool.block_bytes
    for page in range(5):
        start = pool.page_offset(page)
        offsets = sorted(pool.block_offset(page, head, layer, kv) for head in range(2) for layer in range(3)
                         for kv in (0, 1))
        assert offsets == [start + i * pool.block_bytes for i in range(12)]
    pool.kv_cache[:, :, 3] = 1.0          # writing page 3 through the model's view...
    touched = torch.nonzero(pool.storage.reshape(5, -1).sum(dim=1)).flatten().tolist()
    assert touched == [3]                 # ...touches page 3's region only


def test_kv_pool_host_memory_is_huge_page_aligned_and_same_layout_without():
    """A CPU pool starts on a 2 MiB boundary (where transparent huge pages can back it) and is zeroed; with
    ``huge_pages=False`` (torch's allocator) the layout and values are the same."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, page_size=16)
    huge = KVPool(shape, num_pages=5, dtype=torch.float16, device="cpu")
    plain = KVPool(shape, num_pages=5, dtype=torch.float16, device="cpu", huge_pages=False)
    assert huge.base_ptr % HUGE_PAGE_BYTES == 0
    assert huge.storage.is_contiguous() and huge.storage.shape == plain.storage.shape
    assert huge.storage.dtype == torch.float16 and huge.nbytes == plain.nbytes
    assert torch.count_nonzero(huge.storage) == 0
    for pool in (huge, plain):
        pool.kv_cache[1, 0, 2] = 1.0
    assert torch.equal(huge.storage, plain.storage)
    assert huge.block_offset(2, 0, 1, 0) == huge.kv_cache[1, 0, 2, :, 0].data_ptr() - huge.base_ptr


def test_a_host_pool_is_populated_in_the_background_without_losing_writes():
    """A host pool of several huge pages is faulted in by a thread that changes no byte: what the engine
    writes while it runs stays, everything else reads zero (the mapping is never written at construction)."""
    shape = KVShape(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16)   # 64 KiB pages
    pool = KVPool(shape, num_pages=256, dtype=torch.float32, device="cpu")     # 16 MiB: 8 huge pages
    assert pool.populating is not None, "this kernel refused MADV_POPULATE_WRITE"
    pool.kv_cache[3, 1, 255] = 7.0    # the last page, most likely written before the thread reaches it
    pool.kv_cache[0, 0, 0] = 5.0
    pool.populating.join(timeout=30)
    assert not pool.populating.is_alive()
    assert torch.all(pool.kv_cache[3, 1, 255] == 7.0) and torch.all(pool.kv_cache[0, 0, 0] == 5.0)
    assert torch.count_nonzero(pool.storage) == 2 * pool.kv_cache[0, 0, 0].numel()
    assert KVPool(shape, num_pages=4, dtype=torch.float32, device="cpu", huge_pages=False).populating is None


def test_pages_for_bytes_rounds_down():
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4)
    page_bytes = shape.page_bytes(torch.float32)
    assert page_bytes == 2 * 2 * 4 * 1 * 2 * 4
    assert shape.pages_for_bytes(3 * page_bytes + 1, torch.float32) == 3


def test_kv_pool_populates_through_the_raw_madvise_syscall():
    """The background populate calls ``madvise`` as a raw system call, never libc's ``madvise`` (which UCX
    live-patches while NIXL starts: a thread inside it then can crash); it faults a fresh mapping in with its
    contents unchanged, and reports a bad address as -1."""
    import mmap as mmap_module

    from engine import kv_pool

    if kv_pool._SYS_MADVISE is None:
        pytest.skip("no raw madvise number for this architecture: libc's is used")
    madvise = kv_pool._raw_madvise()
    assert not hasattr(madvise, "argtypes")   # a Python wrapper over syscall(2), not the libc symbol
    region = mmap_module.mmap(-1, 4 * HUGE_PAGE_BYTES,
                              flags=mmap_module.MAP_PRIVATE | mmap_module.MAP_ANONYMOUS)
    base = torch.frombuffer(memoryview(region), dtype=torch.uint8, count=1).data_ptr()
    aligned = base + (-base % 4096)
    assert madvise(aligned, HUGE_PAGE_BYTES, kv_pool._MADV_POPULATE_WRITE) in (0, -1)   # -1: kernel < 5.14
    assert madvise(aligned, HUGE_PAGE_BYTES, mmap_module.MADV_NORMAL) == 0
    assert madvise(aligned + 1, 4096, mmap_module.MADV_NORMAL) == -1   # not page aligned: EINVAL
    assert bytes(region[:16]) == bytes(16)
    del madvise
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, page_size=16)
    pool = KVPool(shape, num_pages=2048, dtype=torch.float32, device="cpu")
    if pool.populating is not None:
        pool.populating.join(30)
    assert torch.count_nonzero(pool.kv_cache) == 0
