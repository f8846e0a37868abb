"""Prefix cache (CONTRACT §5): a radix tree of full KV pages keyed by their tokens.

A node holds a run of pages whose K/V are those of their tokens after every token on the path
from the root, at positions 0, 1, ...: a causal prefix, reusable by any sequence starting
with the same tokens. A query's pages are one node until another query shares only part of
them (the node is split there), so a forward's cache work follows its queries, not their
pages. The cache holds one reference per node's page; eviction frees the last pages of least
recently used leaves that nobody else holds.

Eviction never walks the tree. Every node is kept in one LRU order, and a touch moves a path's
nodes to its newest end deepest first, so a node is always newer than its descendants and the
oldest node is a leaf: evicting a page costs O(1), plus the in-use leaves it steps over, which
are bounded by the forwards in flight, not by the cache.
"""
import collections

import numpy as np

from runtime.pages import PagePool


class _Node:
    __slots__ = ("keys", "pages", "parent", "children")

    def __init__(self, keys: list[bytes], pages: list[int], parent: "_Node | None"):
        """`keys`: each page's tokens; the parent finds the node by its first."""
        self.keys, self.pages, self.parent = keys, pages, parent
        self.children: dict[bytes, _Node] = {}


def _common(keys: list[bytes], others: list[bytes], start: int) -> int:
    """How many leading `keys` equal `others[start:]`."""
    n = 0
    for a, b in zip(keys, others[start:]):
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._root = _Node([], [], None)
        self._lru: collections.OrderedDict[_Node, None] = collections.OrderedDict()  # oldest 1st

    def _keys(self, tokens: np.ndarray | list[int], max_pages: int) -> list[bytes]:
        """The leading full pages' tokens (at most `max_pages`), each as int32 bytes: hashed
        and compared in C."""
        size = self.page_size
        n = min(max_pages, len(tokens) // size)
        data, width = np.asarray(tokens[:n * size], np.int32).tobytes(), size * 4
        return [data[i * width:(i + 1) * width] for i in range(n)]

    def match(self, tokens: np.ndarray | list[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (at most `max_pages`), each
        retained once for the caller, who releases them to the pool when done."""
        keys, node, done, pages, path = self._keys(tokens, max_pages), self._root, 0, [], []
        while done < len(keys) and (child := node.children.get(keys[done])) is not None:
            same = _common(child.keys, keys, done)
            pages += child.pages[:same]
            path.append(child)
            if same < len(child.keys):
                break
            node, done = child, done + same
        self._touch(path)
        self.pool.retain(pages)
        return pages

    def insert(self, tokens: np.ndarray | list[int], pages: list[int]) -> int:
        """Caches the leading full pages of `tokens`, whose K/V are (or are being written)
        in `pages`. Prefixes cached already keep their pages. Returns the pages added."""
        keys, node, done, path, added = self._keys(tokens, len(pages)), self._root, 0, [], 0
        while done < len(keys):
            child = node.children.get(keys[done])
            if child is None:
                child = _Node(keys[done:], pages[done:len(keys)], node)
                node.children[keys[done]] = child
                self.pool.retain(child.pages)
                path.append(child)
                added = len(child.pages)
                break
            same = _common(child.keys, keys, done)
            if same < len(child.keys) and done + same < len(keys):
                child = self._split(child, same)
            path.append(child)
            node, done = child, done + same
        self._touch(path)
        return added

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts `node` after its first `at` pages: returns the new upper part, its parent."""
        upper = _Node(node.keys[:at], node.pages[:at], node.parent)
        node.parent.children[upper.keys[0]] = upper
        node.keys, node.pages, node.parent = node.keys[at:], node.pages[at:], upper
        upper.children[node.keys[0]] = node
        self._lru[upper] = None  # newer than `node`, as a parent is
        return upper

    def _touch(self, path: list[_Node]) -> None:
        """Marks a path from the root used now, its deepest node first."""
        for node in reversed(path):
            self._lru[node] = None
            self._lru.move_to_end(node)

    def clear(self) -> None:
        """Drops every cached prefix (K/V that may never have been written)."""
        for node in list(self._root.children.values()):
            del self._root.children[node.keys[0]]
            self.pool.release(self._detach(node))

    def evict(self, pages_wanted: int) -> int:
        """Frees up to `pages_wanted` pages, the last ones of least recently used leaves
        first; returns how many."""
        freed, in_use = [], 0
        while len(freed) < pages_wanted and in_use < len(self._lru):
            node = next(iter(self._lru))
            first = node.keys[0]
            while (node.pages and not node.children and len(freed) < pages_wanted
                   and self.pool.refcount(node.pages[-1]) == 1):
                freed.append(node.pages.pop())
                node.keys.pop()
            if not node.pages:
                del node.parent.children[first]
                del self._lru[node]
            elif len(freed) < pages_wanted:  # a forward holds it, or it is not a leaf:
                self._lru.move_to_end(node)  # it is being used now
                in_use += 1
        self.pool.release(freed)
        return len(freed)

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
            pages += n.pages
            stack.extend(n.children.values())
            n.parent, n.children = None, {}
            del self._lru[n]
        return pages

    def pages(self) -> list[int]:
        """Every page the cache holds (one reference each)."""
        return [p for n in self._nodes() for p in n.pages]
