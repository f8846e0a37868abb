"""Fixed pool of KV pages with reference counts: a page is free when nobody holds it.

Holders are sequences in flight and the prefix cache; each holds one reference per page.
Pages are handed out lowest first and a released run comes back in its own order, so a
sequence's pages mostly follow each other in the pool: the TPU attention kernel copies a KV
block of consecutive pages in one DMA, not one a page.
"""


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int) -> list[int]:
        """`count` free pages, each with one reference."""
        if count > len(self._free):
            raise MemoryError(f"need {count} KV pages, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(count)]
        for page in taken:
            self._refs[page] = 1
        return taken

    def retain(self, pages: list[int]) -> None:
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is free: nothing to share")
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in reversed(pages):  # the free list is a stack: its top is taken first
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} released more often than held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def check(self, holders: list[list[int]]) -> None:
        """Raises AssertionError unless every page's count equals the references in
        `holders` (one page list per holder) and free pages are exactly the unheld ones."""
        counts = [0] * self.num_pages
        for pages in holders:
            for page in pages:
                counts[page] += 1
        assert counts == self._refs, "page reference counts disagree with their holders"
        free = sorted(self._free)
        assert free == [p for p, n in enumerate(counts) if n == 0], "free list is wrong"
