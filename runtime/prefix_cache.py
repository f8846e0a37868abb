"""Prefix cache (CONTRACT §5): a radix tree of full KV pages keyed by their tokens.

A node holds one page whose K/V are those of its tokens after every token on the path
from the root, at positions 0, 1, ...: a causal prefix, reusable by any sequence starting
with the same tokens. The cache holds one reference per node's page; eviction removes
least-recently-used leaves whose page nobody else holds.
"""
import dataclasses
import heapq
import itertools

from runtime.pages import PagePool


@dataclasses.dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: "_Node | None"
    children: dict = dataclasses.field(default_factory=dict)
    last_use: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)

    def _keys(self, tokens: list[int], max_pages: int):
        size = self.page_size
        for i in range(min(max_pages, len(tokens) // size)):
            yield tuple(tokens[i * size:(i + 1) * size])

    def match(self, tokens: list[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (at most `max_pages`), each
        retained once for the caller, who releases them to the pool when done."""
        node, pages, now = self._root, [], next(self._clock)
        for key in self._keys(tokens, max_pages):
            node = node.children.get(key)
            if node is None:
                break
            node.last_use = now
            pages.append(node.page)
        self.pool.retain(pages)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> list[_Node]:
        """Caches the leading full pages of `tokens`, whose K/V are (or are being written)
        in `pages`. Prefixes cached already keep their page. Returns the new nodes."""
        node, added, now = self._root, [], next(self._clock)
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, page, node)
                node.children[key] = child
                self.pool.retain([page])
                added.append(child)
            child.last_use = now
            node = child
        return added

    def remove(self, nodes: list[_Node]) -> None:
        """Drops `nodes` and everything below them (K/V that were never written)."""
        for node in nodes:
            if node.parent is not None:  # not removed already with an ancestor
                del node.parent.children[node.key]
                self.pool.release(self._detach(node))

    def clear(self) -> None:
        self.remove(list(self._root.children.values()))

    def evict(self, pages_wanted: int) -> int:
        """Frees up to `pages_wanted` pages, least recently used leaves first; returns how many."""
        heap = [(n.last_use, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < pages_wanted:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.pool.release(self._detach(node))
            freed += 1
            if parent is not self._root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.pool.refcount(node.page) == 1

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    @staticmethod
    def _detach(node: _Node) -> list[int]:
        """Unlinks a subtree; returns its pages."""
        pages, stack = [], [node]
        while stack:
            n = stack.pop()
            pages.append(n.page)
            stack.extend(n.children.values())
            n.parent, n.children = None, {}
        return pages

    def pages(self) -> list[int]:
        """Every page the cache holds (one reference each)."""
        return [n.page for n in self._nodes()]
