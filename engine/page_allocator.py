"""Page allocator: pure bookkeeping of which KV pages are free. No tensors."""

from __future__ import annotations

from collections import deque

PageId = int


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1`` and takes them back, with exact accounting.

    Pages are handed out lowest-first on a fresh allocator and reused FIFO after that, which keeps a fresh
    request's pages contiguous (fewer transfer descriptors).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[PageId] = deque(range(num_pages))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        """Pages available to ``allocate``."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[PageId]:
        """Take ``n`` free pages.

        Raises:
            ValueError: ``n`` is negative or more than ``num_free`` (nothing is taken then).
        """
        if n < 0 or n > len(self._free):
            raise ValueError(f"cannot allocate {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[PageId]) -> None:
        """Give pages back.

        Raises:
            ValueError: a page id outside the pool, a page already free, or a page listed twice
                (nothing is freed then).
        """
        seen: set[PageId] = set()
        for p in pages:
            if not (isinstance(p, int) and 0 <= p < self.num_pages):
                raise ValueError(f"page {p!r} is not in this pool of {self.num_pages} pages")
            if self._is_free[p] or p in seen:
                raise ValueError(f"page {p} is already free (double free)")
            seen.add(p)
        for p in pages:
            self._is_free[p] = True
            self._free.append(p)
