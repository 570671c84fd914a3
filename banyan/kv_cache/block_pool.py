"""BlockPool: the fixed set of KV pages 0..num_pages-1, a free list and a reference count per page.

A page is free exactly when its count is 0. Each holder (a request, the radix tree) owns one
reference; the last `decref` puts the page back on the free list. The pool knows nothing about
tokens or prefixes.

The free list is a stack: the page freed last is handed out first. Its K/V rows are likely still in the
CPU's caches, and a pool allocated lazily (the runner's CPU pools: memory the OS backs on first write)
stays backed only as far as the most pages ever in use, instead of growing through every page.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from banyan.errors import BanyanError, InvalidParameterError


class KVCacheIntegrityError(BanyanError):
    """The KV cache's bookkeeping broke one of its invariants: a bug in banyan, not a user error."""


class BlockPool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise InvalidParameterError("num_pages", f"must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages - 1, -1, -1))  # the top (right) end is allocated first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, page: int) -> int:
        self._check_ids((page,))
        return self._ref[page]

    def allocate(self, n: int) -> list[int] | None:
        """Take n free pages, each with ref count 1.

        Returns None, taking nothing, when fewer than n are free: running short is an outcome the
        caller plans for (evict, preempt), not an error.
        """
        if n < 0:
            raise InvalidParameterError("n", f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._ref[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more holder for each page; a free page cannot gain holders (allocate it instead)."""
        pages = list(pages)
        self._check_ids(pages)
        for page in pages:
            if self._ref[page] == 0:
                raise KVCacheIntegrityError(f"incref of free page {page}")
        for page in pages:
            self._ref[page] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """One holder fewer for each page; returns the pages that became free (in order)."""
        drops = Counter(pages)
        self._check_ids(drops)
        # Validate everything first so a bad call changes nothing.
        for page, n in drops.items():
            if n > self._ref[page]:
                raise KVCacheIntegrityError(f"decref of page {page} below zero ({self._ref[page]} - {n})")
        freed = []
        for page, n in drops.items():
            self._ref[page] -= n
            if self._ref[page] == 0:
                freed.append(page)
        self._free.extend(reversed(freed))  # the first freed on top: a request's pages come back in its order
        return freed

    def check_integrity(self) -> None:
        """The free list holds each page at most once, and exactly the pages with ref count 0."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVCacheIntegrityError("a page is on the free list twice")
        unreferenced = {p for p, ref in enumerate(self._ref) if ref == 0}
        if free != unreferenced:
            raise KVCacheIntegrityError(
                f"free list and zero ref counts disagree: only free {sorted(free - unreferenced)[:8]}, "
                f"only unreferenced {sorted(unreferenced - free)[:8]}"
            )
        if any(ref < 0 for ref in self._ref):
            raise KVCacheIntegrityError("negative ref count")

    def _check_ids(self, pages: Iterable[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise KVCacheIntegrityError(f"page id {page} outside 0..{self.num_pages - 1}")
