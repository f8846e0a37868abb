"""Prefix cache (CONTRACT §5): a radix tree of full KV pages keyed by their tokens.

A node holds one page whose K/V are those of its tokens after every token on the path
from the root, at positions 0, 1, ...: a causal prefix, reusable by any sequence starting
with the same tokens. The cache holds one reference per node's page; eviction removes
least-recently-used leaves whose page nobody else holds.

Eviction never walks the tree. Every node is kept in one LRU order, and a touch moves a path's
nodes to its newest end deepest first, so a node is always newer than its descendants and the
oldest node is a leaf: evicting a page costs O(1), plus the in-use leaves it steps over, which
are bounded by the forwards in flight, not by the cache.
"""
import collections
import dataclasses

from runtime.pages import PagePool


@dataclasses.dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: "_Node | None"
    children: dict = dataclasses.field(default_factory=dict)


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._root = _Node((), -1, None)
        self._lru: collections.OrderedDict[_Node, None] = collections.OrderedDict()  # oldest 1st

    def _keys(self, tokens: list[int], max_pages: int):
        size = self.page_size
        for i in range(min(max_pages, len(tokens) // size)):
            yield tuple(tokens[i * size:(i + 1) * size])

    def match(self, tokens: list[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (at most `max_pages`), each
        retained once for the caller, who releases them to the pool when done."""
        node, path = self._root, []
        for key in self._keys(tokens, max_pages):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        self._touch(path)
        pages = [n.page for n in path]
        self.pool.retain(pages)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> list[_Node]:
        """Caches the leading full pages of `tokens`, whose K/V are (or are being written)
        in `pages`. Prefixes cached already keep their page. Returns the new nodes."""
        node, added, path = self._root, [], []
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, page, node)
                node.children[key] = child
                self.pool.retain([page])
                added.append(child)
            path.append(child)
            node = child
        self._touch(path)
        return added

    def _touch(self, path: list[_Node]) -> None:
        """Marks a path from the root used now, its deepest node first."""
        for node in reversed(path):
            self._lru[node] = None
            self._lru.move_to_end(node)

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
        freed, in_use = 0, 0
        while freed < pages_wanted and in_use < len(self._lru):
            node = next(iter(self._lru))
            if node.children or self.pool.refcount(node.page) > 1:  # a forward holds it:
                self._lru.move_to_end(node)  # it is being used now
                in_use += 1
                continue
            del node.parent.children[node.key]
            self.pool.release(self._detach(node))
            freed += 1
        return freed

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _detach(self, node: _Node) -> list[int]:
        """Unlinks a subtree; returns its pages."""
        pages, stack = [], [node]
        while stack:
            n = stack.pop()
            pages.append(n.page)
            stack.extend(n.children.values())
            n.parent, n.children = None, {}
            del self._lru[n]
        return pages

    def pages(self) -> list[int]:
        """Every page the cache holds (one reference each)."""
        return [n.page for n in self._nodes()]
