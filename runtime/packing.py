"""Sequences of one forward pass (CONTRACT §4): multi-item packing and plain causal prompts."""
import dataclasses

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
    cacheable: int = dataclasses.field(init=False)  # see `causal_prefix_len`
    first_row: int = dataclasses.field(init=False)  # the first scored row (n if none)

    def __post_init__(self):
        for name in ("tokens", "positions", "visible_from", "score_rows"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), np.int32))
        object.__setattr__(self, "cacheable", causal_prefix_len(self.positions,
                                                                self.visible_from))
        object.__setattr__(self, "first_row", int(self.score_rows.min(
            initial=len(self.tokens))))


def causal_prefix_len(positions: np.ndarray, visible_from: np.ndarray) -> int:
    """Leading tokens whose K/V are those of a plain causal prompt (the prefix cache may hold
    them): the query of a multi-item sequence (and its first item if the query is empty)."""
    plain = (positions == np.arange(len(positions))) & (visible_from == 0)
    return len(plain) if plain.all() else int(plain.argmin())


def causal_sequence(prompt: Tokens) -> Sequence:
    n = len(prompt)
    return Sequence(prompt, np.arange(n), np.zeros(n), 0, [n - 1])


def multi_item_sequence(query: Tokens, items: list[Tokens]) -> Sequence:
    """query, item_1, ..., item_N in one sequence; item k attends to the query and itself."""
    shared, lens = len(query), np.fromiter(map(len, items), np.int64, len(items))
    ends = shared + np.cumsum(lens)
    starts = ends - lens
    owner = np.repeat(np.arange(len(items)), lens)  # the item of each item token
    tokens = np.concatenate([np.asarray(t, np.int32) for t in [query, *items]])
    within = np.arange(len(tokens) - shared) - (starts - shared)[owner]
    return Sequence(tokens, np.concatenate([np.arange(shared), shared + within]),
                    np.concatenate([np.zeros(shared, np.int64), starts[owner]]), shared,
                    np.where(lens > 0, ends - 1, shared - 1))


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
