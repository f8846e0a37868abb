"""The page pool and the prefix cache on their own: sharing, LRU eviction, rollback."""
import time

import numpy as np
import pytest

from runtime.pages import PagePool
from runtime.prefix_cache import PrefixCache


def cache_with(num_pages=8, page_size=2):
    pool = PagePool(num_pages)
    return pool, PrefixCache(pool, page_size)


def cache_sequence(pool, cache, tokens):
    """What the scheduler does for a sequence: match, allocate the rest, cache, finish."""
    cached = cache.match(tokens, len(tokens) // cache.page_size)
    pages = cached + pool.allocate(-(-len(tokens) // cache.page_size) - len(cached))
    cache.insert(tokens, pages)
    pool.release(pages)
    return cached


def test_pool_counts_and_refuses_double_release():
    pool = PagePool(3)
    a = pool.allocate(2)
    pool.retain(a[:1])
    pool.release(a)
    assert pool.free_count == 2 and pool.refcount(a[0]) == 1
    pool.check([a[:1]])
    pool.release(a[:1])
    with pytest.raises(ValueError, match="released more often"):
        pool.release(a[:1])
    with pytest.raises(MemoryError):
        pool.allocate(4)


def test_match_reuses_full_pages_of_the_longest_cached_prefix():
    pool, cache = cache_with()
    assert cache_sequence(pool, cache, [1, 2, 3, 4, 5]) == []
    hit = cache.match([1, 2, 3, 4, 9, 9], 3)
    assert len(hit) == 2 and all(pool.refcount(p) == 2 for p in hit)
    pool.release(hit)
    one = cache.match([1, 2, 3, 4], 1)  # max_pages caps the match
    assert one == hit[:1]
    assert cache.match([2, 1], 1) == []
    pool.check([cache.pages(), one])


def test_evicts_least_recently_used_leaves_first():
    pool, cache = cache_with(num_pages=8)
    cache_sequence(pool, cache, [1, 1, 2, 2])  # pages a, b
    cache_sequence(pool, cache, [3, 3, 4, 4])  # pages c, d
    pool.release(cache.match([1, 1, 2, 2], 2))  # touch the first prefix
    assert cache.evict(1) == 1
    held = cache.match([3, 3, 4, 4], 2)
    assert len(held) == 1  # the least recently used leaf, [4, 4], went first
    assert cache.evict(8) == 2  # then [2, 2] and [1, 1]; [3, 3] is held
    pool.check([cache.pages(), held])
    assert cache.pages() == held


def test_held_pages_are_never_evicted():
    pool, cache = cache_with(num_pages=4)
    cache_sequence(pool, cache, [1, 1, 2, 2])
    held = cache.match([1, 1, 2, 2], 2)
    assert cache.evict(4) == 0
    pool.release(held)
    assert cache.evict(4) == 2 and pool.free_count == 4


def test_insert_keeps_the_first_page_of_a_prefix_and_remove_drops_subtrees():
    pool, cache = cache_with()
    first = pool.allocate(2)
    added = cache.insert([5, 5, 6, 6], first)
    second = pool.allocate(2)
    assert cache.insert([5, 5, 6, 6], second) == []  # cached already: the page stays private
    pool.release(second)
    assert cache.match([5, 5, 6, 6], 2) == first
    pool.release(first)
    pool.release(first)
    cache.remove(added[:1] + added)  # an ancestor and its descendant: released once each
    assert cache.pages() == [] and pool.free_count == 8
    pool.check([])


def full_cache(num_pages: int, chain: int = 8):
    """A pool whose every page the cache holds: prefixes of `chain` pages, each its own
    query, inserted as the scheduler inserts them, touched in a scattered order."""
    pool, cache = cache_with(num_pages, page_size=1)
    for first in range(0, num_pages, chain):
        cache_sequence(pool, cache, list(range(first, first + chain)))
    order = np.random.default_rng(0).permutation(num_pages // chain) * chain
    for first in order[:len(order) // 2]:
        pool.release(cache.match(list(range(first, first + chain)), chain))
    assert pool.free_count == 0
    return pool, cache


def seconds_per_eviction(cache, evictions: int) -> float:
    start = time.perf_counter()
    for _ in range(evictions):
        assert cache.evict(1) == 1
    return (time.perf_counter() - start) / evictions


def test_evicting_a_page_costs_the_same_in_a_pool_of_a_million_tokens():
    """Eviction never walks the tree: a page from a full cache of 1M tokens (65,536 pages of
    16) costs what it costs from one ten times smaller. Best of five rounds each, in turn."""
    large, small = full_cache(65536)[1], full_cache(6552)[1]
    best = {"large": np.inf, "small": np.inf}
    for _ in range(5):
        best["large"] = min(best["large"], seconds_per_eviction(large, 1000))
        best["small"] = min(best["small"], seconds_per_eviction(small, 1000))
    assert best["large"] < 1.5 * best["small"], best
