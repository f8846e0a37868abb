"""The attention plan's rule one segment at a time, in Python loops: what
kernels.attention_plan.build_plan computes with array operations, written the plain way."""
import numpy as np

from kernels.attention_plan import BlockSizes


def needed_kv_blocks(pos: np.ndarray, vis: np.ndarray, shared_len: int, kv_block: int,
                     window: int = 0):
    """KV block indices some row (kv position `pos`, visible-from `vis`) can see: `sees` on
    intervals. A row sees [0, min(L, pos + 1)) and [vis, pos]; with a window, of the first
    only from its logical position (pos less its item's distance from the query) - W + 1,
    of the second only from pos - W + 1, the segment's rows taken by their least bounds."""
    p_max, a_min = int(pos.max()), int(vis.min())
    own_from, shared_from = a_min, 0
    if window:
        logical = pos - np.maximum(vis - shared_len, 0)
        own_from = max(a_min, int(pos.min()) - window + 1)
        shared_from = max(int(logical.min()) - window + 1, 0)
    blocks = set(range(own_from // kv_block, p_max // kv_block + 1))
    shared_end = min(shared_len, p_max + 1)
    if shared_end > shared_from:
        blocks |= set(range(shared_from // kv_block, (shared_end - 1) // kv_block + 1))
    return sorted(blocks)


def segments(lo: int, hi: int, q_block: int):
    """Tokens [lo, hi) cut where q blocks start: (block, start, end) pieces."""
    while lo < hi:
        end = min(hi, (lo // q_block + 1) * q_block)
        yield lo // q_block, lo, end
        lo = end


def kv_split(pos, vis, shared_len: int, kv_len: int, sizes: BlockSizes) -> int:
    past_query = pos - np.maximum(vis, shared_len) + 1
    short = past_query.max(initial=0) <= sizes.item_kv_block
    beyond_query_block = kv_len > -(-shared_len // sizes.kv_block) * sizes.kv_block
    items = sizes.item_q_block and shared_len > 0 and short and beyond_query_block
    return shared_len if items else kv_len


def item_windows(pos, vis, split: int, sizes: BlockSizes, page_size: int) -> list[int]:
    rows = pos >= split
    if not rows.any():
        return []
    first = int(np.maximum(vis[rows], split).min()) // page_size * page_size
    return list(range(first, int(pos[rows].max()) + 1, sizes.item_kv_block))


def plan_steps(cu, kv_lens, shared_lens, visible_from, sizes: BlockSizes, page_size: int,
               window: int = 0):
    """(token positions, token sequences, block steps, item steps, splits) as lists."""
    cu, kv_lens, visible_from = map(np.asarray, (cu, kv_lens, visible_from))
    pos = np.full(len(visible_from), -1)
    seq = np.full(len(visible_from), -1)
    steps, item_steps, splits = [], [], []
    for s in range(len(kv_lens)):
        lo, hi, shared = int(cu[s]), int(cu[s + 1]), int(shared_lens[s])
        pos[lo:hi] = kv_lens[s] - (hi - lo) + np.arange(hi - lo)
        seq[lo:hi] = s
        split = kv_split(pos[lo:hi], visible_from[lo:hi], shared, int(kv_lens[s]), sizes)
        splits.append(split)
        for block, a, b in segments(lo, hi, sizes.q_block):
            kv = needed_kv_blocks(pos[a:b], visible_from[a:b], shared, sizes.kv_block, window)
            steps += [(block, s, k) for k in kv if k * sizes.kv_block < split]
        if split < kv_lens[s]:
            for block, a, b in segments(lo, hi, sizes.item_q_block):
                starts = item_windows(pos[a:b], visible_from[a:b], split, sizes, page_size)
                item_steps += [(block, s, start) for start in starts]
    return pos.tolist(), seq.tolist(), steps, item_steps, splits
