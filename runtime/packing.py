"""Sequences of one forward pass (CONTRACT §4): multi-item packing and plain causal prompts."""
import dataclasses
import itertools

import numpy as np

Tokens = list[int]


@dataclasses.dataclass(frozen=True, eq=False)
class Sequence:
    """A sequence's tokens and where its parts start, as int32 arrays, made where the request
    is taken apart (its own thread). The per-token RoPE positions and visible_from follow from
    the parts: `token_fields` derives them for a whole forward at once."""
    tokens: np.ndarray        # [n]
    bounds: np.ndarray        # [parts + 1] where each part starts (the shared tokens, if
                              # any, then each item), then n
    shared_len: int           # L: KV positions every token sees (a multi-item query)
    score_rows: np.ndarray    # [items] indices into tokens of the rows to score, one per item
    cacheable: int            # leading tokens whose K/V are a plain causal prompt's (the prefix
                              # cache may hold them): position i, visible from 0
    first_row: int            # the first scored row (n if none)

    def __post_init__(self):
        for name in ("tokens", "bounds", "score_rows"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), np.int32))

    @property
    def positions(self) -> np.ndarray:
        return token_fields([self], [0], [0])[0]

    @property
    def visible_from(self) -> np.ndarray:
        return token_fields([self], [0], [0])[1]


def causal_sequence(prompt: Tokens) -> Sequence:
    n = len(prompt)
    return Sequence(prompt, [0, n], 0, [n - 1], n, n - 1)


def multi_item_sequence(query: Tokens, items: list[Tokens]) -> Sequence:
    """query, item_1, ..., item_N in one sequence; item k attends to the query and itself."""
    shared, lens = len(query), [len(item) for item in items]
    bounds = list(itertools.accumulate(lens, initial=shared))  # item k: [bounds[k], bounds[k+1])
    n = bounds[-1]
    rows = [end - 1 if size else shared - 1 for end, size in zip(bounds[1:], lens)]
    # the query is a causal prompt; without one, so is the first item with tokens
    cacheable = shared or next((size for size in lens if size), 0)
    return Sequence(np.fromiter(itertools.chain(query, *items), np.int32, n),
                    [0, *bounds] if shared else bounds, shared, rows, cacheable,
                    min(rows, default=n))


def token_fields(seqs: list[Sequence], skips: list[int],
                 pads: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The RoPE positions and visible_from of each sequence's tokens from skips[k] on, followed
    by pads[k] padding tokens, packed. A shared token i is at position i, visible from 0; a
    token i of the item starting at s is at position L + i - s, visible from s; a padding
    token at KV position i is at i and sees the shared tokens and itself (from i). A forward
    at a time: a NumPy call costs about the same for its thousands of tokens as for one
    request's hundreds."""
    if not seqs:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    counts = np.fromiter((len(s.bounds) for s in seqs), np.int64, len(seqs))
    sizes = np.fromiter((len(s.tokens) - k + p for s, k, p in zip(seqs, skips, pads)),
                        np.int64, len(seqs))
    total = int(sizes.sum())
    starts = np.concatenate([s.bounds for s in seqs])  # each part's, then the padding's
    # the packed index of each sequence's KV position 0, and of each part's first new token
    base = np.repeat((np.cumsum(sizes) - sizes - skips).astype(np.int32), counts)
    first = base + np.maximum(starts, np.repeat(np.asarray(skips, np.int32), counts))
    shift = np.maximum(starts - np.repeat(np.array([s.shared_len for s in seqs], np.int32),
                                          counts), 0)
    padding = np.zeros(len(starts), bool)
    padding[np.cumsum(counts) - 1] = True
    shift[padding] = 0
    lens = np.empty_like(first)
    lens[:-1] = first[1:]
    lens[-1] = total
    lens -= first
    positions = np.arange(total, dtype=np.int32) - np.repeat(base + shift, lens)
    return positions, np.where(np.repeat(padding, lens), positions, np.repeat(starts, lens))


def item_chunks(query_len: int, item_lens: list[int], budget: int, max_items: int) -> list[range]:
    """Groups consecutive items so that query + items of a group fit in `budget` tokens
    and a group has at most `max_items` items (empty items cost a scored row, not a token)."""
    if query_len + sum(item_lens) <= budget and len(item_lens) <= max_items:
        return [range(len(item_lens))] if item_lens else []  # one group, without the walk
    chunks, start, used = [], 0, query_len
    for k, n in enumerate(item_lens):
        if k > start and (used + n > budget or k - start == max_items):
            chunks.append(range(start, k))
            start, used = k, query_len
        used += n
    if start < len(item_lens):
        chunks.append(range(start, len(item_lens)))
    return chunks
