"""Sequences of one forward pass (CONTRACT §4): multi-item packing and plain causal prompts."""
import dataclasses
import itertools

import numpy as np

Tokens = list[int]


@dataclasses.dataclass(frozen=True, eq=False)
class Sequence:
    """Per-token fields as int32 arrays, made where the request is taken apart (its own
    thread), so that the scheduler slices and concatenates them instead of walking lists."""
    tokens: np.ndarray        # [n]
    positions: np.ndarray     # [n] RoPE positions
    visible_from: np.ndarray  # [n] a(i) per token
    shared_len: int           # L: KV positions every token sees (a multi-item query)
    score_rows: np.ndarray    # [items] indices into tokens of the rows to score, one per item
    cacheable: int            # leading tokens whose K/V are a plain causal prompt's (the prefix
                              # cache may hold them): position i, visible from 0
    first_row: int            # the first scored row (n if none)

    def __post_init__(self):
        for name in ("tokens", "positions", "visible_from", "score_rows"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), np.int32))


def causal_sequence(prompt: Tokens) -> Sequence:
    n = len(prompt)
    return Sequence(prompt, np.arange(n), np.zeros(n), 0, [n - 1], n, n - 1)


def multi_item_sequence(query: Tokens, items: list[Tokens]) -> Sequence:
    """query, item_1, ..., item_N in one sequence; item k attends to the query and itself.
    Per item in Python, per token in NumPy: a request's few items cost less as ints than as
    arrays."""
    shared, lens = len(query), [len(item) for item in items]
    bounds = list(itertools.accumulate(lens, initial=shared))  # item k: [bounds[k], bounds[k+1])
    n = bounds[-1]
    item_start = np.repeat(np.array(bounds[:-1], np.int32), lens)  # of each item token
    positions = np.arange(n, dtype=np.int32)
    positions[shared:] -= item_start - shared
    visible_from = np.zeros(n, np.int32)
    visible_from[shared:] = item_start
    rows = [end - 1 if size else shared - 1 for end, size in zip(bounds[1:], lens)]
    # the query is a causal prompt; without one, so is the first item with tokens
    cacheable = shared or next((size for size in lens if size), 0)
    return Sequence(np.fromiter(itertools.chain(query, *items), np.int32, n), positions,
                    visible_from, shared, rows, cacheable, min(rows, default=n))


def item_chunks(query_len: int, item_lens: list[int], budget: int, max_items: int) -> list[range]:
    """Groups consecutive items so that query + items of a group fit in `budget` tokens
    and a group has at most `max_items` items (empty items cost a scored row, not a token)."""
    chunks, start, used = [], 0, query_len
    for k, n in enumerate(item_lens):
        if k > start and (used + n > budget or k - start == max_items):
            chunks.append(range(start, k))
            start, used = k, query_len
        used += n
    if start < len(item_lens):
        chunks.append(range(start, len(item_lens)))
    return chunks
