"""Prefix cache: full KV pages indexed by their token content, reference-counted, evicted LRU. No tensors.

Why chained page hashes (vLLM's hash-based prefix caching, ``vllm/v1/core/kv_cache_utils.py``) rather than a
radix tree (SGLang): a page's key is ``H(parent key, the page's token ids)``, so it names the page's whole
prefix; matching a prompt is one dict lookup per page (O(1) each), there is no tree to split or rebalance, and
the unit of sharing is the unit the pool allocates (a page), so a hit never needs a partial-page copy. Keys
are SHA-256 digests: a collision would silently serve another prompt's KV, and 64-bit ``hash()`` is not safe
enough at scale; the cost (~1 µs per page) is noise next to a forward.

Page states (each page is in exactly one):

1. free: in the ``PageAllocator``'s free list, no key.
2. in use: held by ``ref_count >= 1`` live requests; may have a key (then other requests can share it).
3. cached: ``ref_count == 0`` with a key; its KV stays valid and a new request can take it back (→ 2); it is
   also allocatable: ``allocate`` evicts it (drops the key) when the free list runs dry.

Eviction is LRU over cached pages only, so a page a live request holds is never evicted. It is leaf-first
without tracking children: a request releases its pages last page first, and any request that matched a child
page also matched (and later released) its parent, so a parent is always released no earlier than its children
and sits behind them in the LRU order. One case escapes this: when two requests computed the same page at
once, the key stays with the first one's page, and a child page the second request keys later hangs under a
parent page it never held, so that parent can be evicted first. The orphan is then unreachable (matching
starts at the first page) and ages out; it wastes a page, it never serves wrong KV, because keys name token
content, not pages.

A cached page is never written: keys go only to pages whose every slot holds computed KV, and a request writes
only at positions past its computed (and so past its matched) tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.page_allocator import PageAllocator, PageId

PageHash = bytes


def hash_page(parent: PageHash | None, token_ids: Seq[int]) -> PageHash:
    """Key of a full page: SHA-256 over the parent page's key (empty for the first page) and the page's token
    ids (int64, native byte order)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def page_hashes(token_ids: Seq[int], page_size: int, known: list[PageHash]) -> list[PageHash]:
    """Extend ``known`` (the keys of the first pages, in order) in place to one key per full page of
    ``token_ids``, and return it."""
    for i in range(len(known), len(token_ids) // page_size):
        known.append(hash_page(known[-1] if known else None, token_ids[i * page_size:(i + 1) * page_size]))
    return known


def shareable_pages(num_prompt_tokens: int, page_size: int) -> int:
    """Most leading pages of a prompt a request may share from a prefix cache: full pages that leave at least
    the last prompt token to compute, whose logits sample the first token (vLLM's rule)."""
    return max(0, (num_prompt_tokens - 1) // page_size)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of one engine's prefix cache since it started.

    Attributes:
        queries_tokens: prompt tokens of requests admitted while the cache was on.
        hits_tokens: of those, tokens whose KV came from the cache (page-aligned).
        cached_pages: pages now holding a key (in use or cached), i.e. reusable KV.
        evictable_pages: cached pages no live request holds (allocatable on demand).
    """

    queries_tokens: int = 0
    hits_tokens: int = 0
    cached_pages: int = 0
    evictable_pages: int = 0


class PrefixCache:
    """The engine's page pool: the free list plus cached pages, with reference counts.

    Called only from the engine's thread. With ``enabled=False`` it is the plain allocator (no keys, no
    matches), so one code path serves both settings.

    Args:
        allocator: the free list of never-cached (or evicted) pages.
        enabled: keep and match keys.
    """

    def __init__(self, allocator: PageAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self._ref_count = [0] * allocator.num_pages
        self._key_of: dict[PageId, PageHash] = {}
        self._page_of: dict[PageHash, PageId] = {}
        self._evictable: OrderedDict[PageId, None] = OrderedDict()  # oldest release first
        self.queries_tokens = 0
        self.hits_tokens = 0

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_allocatable(self) -> int:
        """Free pages plus cached pages no request holds."""
        return self.allocator.num_free + len(self._evictable)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries_tokens, self.hits_tokens, len(self._key_of),
                                len(self._evictable))

    def ref_count(self, page: PageId) -> int:
        return self._ref_count[page]

    def match(self, keys: Seq[PageHash]) -> list[PageId]:
        """Pages holding the longest cached run of ``keys`` from the first; takes nothing."""
        pages: list[PageId] = []
        if not self.enabled:
            return pages
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_allocate(self, n: int, sharing: Seq[PageId] = ()) -> bool:
        """Whether ``n`` new pages can be allocated after ``acquire(sharing)`` (which takes cached pages out
        of the allocatable set)."""
        taken = sum(1 for p in sharing if self._ref_count[p] == 0)
        return 0 <= n <= self.num_allocatable - taken

    def acquire(self, pages: Seq[PageId]) -> None:
        """Add a reference to each page (matched pages a new request shares)."""
        for p in pages:
            if self._ref_count[p] == 0:
                del self._evictable[p]
            self._ref_count[p] += 1

    def allocate(self, n: int) -> list[PageId]:
        """Take ``n`` pages (reference count 1, no key): free ones first, then evict least recently released
        cached pages.

        Raises:
            ValueError: fewer than ``n`` allocatable pages (nothing is taken then).
        """
        if not 0 <= n <= self.num_allocatable:
            raise ValueError(f"cannot allocate {n} pages, {self.num_allocatable} allocatable")
        from_free = min(n, self.allocator.num_free)
        pages = self.allocator.allocate(from_free)
        for _ in range(n - from_free):
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            pages.append(page)
        for p in pages:
            self._ref_count[p] = 1
        return pages

    def register(self, page: PageId, key: PageHash) -> None:
        """Give a held page whose every slot holds computed KV its key, so later requests can share it.

        A key already cached under another page (the same prefix computed twice at once) is left alone: this
        page then stays keyless and goes back to the free list on release.
        """
        if self.enabled and key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def release(self, pages: Seq[PageId]) -> None:
        """Drop one reference per page, last page first; a page no one holds becomes cached (keyed) or free.

        Raises:
            ValueError: a page that is not held (nothing is released then).
        """
        if any(not (0 <= p < self.num_pages) or self._ref_count[p] <= 0 for p in pages) or \
                len(set(pages)) != len(pages):
            raise ValueError(f"release of pages not held: {list(pages)}")
        to_free: list[PageId] = []
        for p in reversed(pages):
            self._ref_count[p] -= 1
            if self._ref_count[p] == 0:
                if p in self._key_of:
                    self._evictable[p] = None
                else:
                    to_free.append(p)
        self.allocator.free(to_free[::-1])

    def count_query(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Account one admitted request (tokens)."""
        if self.enabled:
            self.queries_tokens += num_prompt_tokens
            self.hits_tokens += num_cached_tokens
