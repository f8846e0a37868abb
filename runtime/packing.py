"""Sequences of one forward pass (CONTRACT §4): multi-item packing and plain causal prompts."""
import dataclasses

Tokens = list[int]


@dataclasses.dataclass(frozen=True)
class Sequence:
    tokens: Tokens
    positions: list[int]     # RoPE positions
    visible_from: list[int]  # a(i) per token
    shared_len: int          # L: KV positions every token sees (a multi-item query)
    score_rows: list[int]    # indices into tokens of the rows to score, one per item


def causal_sequence(prompt: Tokens) -> Sequence:
    n = len(prompt)
    return Sequence(list(prompt), list(range(n)), [0] * n, 0, [n - 1])


def multi_item_sequence(query: Tokens, items: list[Tokens]) -> Sequence:
    """query, item_1, ..., item_N in one sequence; item k attends to the query and itself."""
    shared = len(query)
    tokens, positions, visible = list(query), list(range(shared)), [0] * shared
    rows = []
    for item in items:
        start = len(tokens)
        tokens += item
        positions += range(shared, shared + len(item))
        visible += [start] * len(item)
        rows.append(len(tokens) - 1 if item else shared - 1)
    return Sequence(tokens, positions, visible, shared, rows)


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


def cacheable_len(seq: Sequence) -> int:
    """Leading tokens whose K/V are those of a plain causal prompt (the prefix cache may hold them):
    the query of a multi-item sequence (and its first item if the query is empty)."""
    for i, (pos, vis) in enumerate(zip(seq.positions, seq.visible_from)):
        if pos != i or vis != 0:
            return i
    return len(seq.tokens)
