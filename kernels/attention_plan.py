"""Host-side block plan for the ragged paged attention kernel.

Queries are cut into q blocks of `q_block` packed tokens, block b holding tokens
[b * q_block, (b + 1) * q_block): the kernels read q and write their output in token order,
whatever the batch's sequences. A block may hold rows of several sequences; each (q block,
sequence) segment gets a step per KV block some row of it can see (CONTRACT §4): the shared blocks
[0, min(L, p_max + 1)) and the blocks of [a_min, p_max], i.e. of the items it overlaps. A
step masks the block's rows of other sequences. Other KV blocks are absent: the kernel neither
copies nor multiplies them. The steps are padded to a fixed count (jit shapes) and
`num_steps` says how many are real.

Item steps (the XLA loop's, where the block sizes name them): a multi-item sequence whose
items see at most `item_kv_block` positions past the query has its block steps cover only
positions below its `kv_split`, the query's L, and item steps cover the rest: per segment of
`item_q_block` tokens, windows of `item_kv_block` positions from the first one its rows see
past L, page-aligned. A row of short items then costs a few window columns past the query,
where KV blocks of 128 would cost 128 or 256.
"""
import dataclasses
from typing import NamedTuple

import numpy as np

FIRST, LAST, NOOP = 1, 2, 4  # step flags


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    q_block: int = 32       # query tokens per block
    kv_block: int = 128     # KV positions per block, a multiple of the page size
    item_q_block: int = 0   # query tokens per item step (0: no item steps)
    item_kv_block: int = 0  # KV positions per item window, a multiple of the page size

    def check(self, page_size: int) -> None:
        if (self.q_block % 8 or self.kv_block % page_size or self.item_q_block % 8
                or self.item_kv_block % page_size
                or (self.item_q_block > 0) != (self.item_kv_block > 0)):
            raise ValueError(f"{self}: q blocks must be multiples of 8, KV blocks multiples "
                             f"of the page size {page_size}, and item steps need both sizes")


# Block sizes by TPU kind: VMEM use stays a few MiB for head_dim 128 and 8 KV heads. On v6e,
# 256/256 (estimated from the compiled schedule, a model): the kernel alone takes 9 / 31 / 145
# us on 10 / 64 / 256 items and 360 us on a 4k causal prefill (Qwen3-0.6B heads, bf16, page
# 16), against 11 / 47 / 185 / 357 us at 512/256 and 11 / 48 / 224 / 367 us at 256/512; the
# whole forward is as fast or faster than at 128/512 in 5 of 6 (model, bucket) pairs, at most
# 2% slower (docs/tpu_v6e.md, "Estimated on v6e from the compiled schedule").
# The planned XLA loop, by platform: on a GPU each step costs some 60 us of launches and a
# loop test read back by the host, whatever its size, so steps there are few and large. On
# CPU, item steps of 16 x 32 take the items off the q blocks of 128 x 128, which then see the
# query only: a forward on SGLang's shape takes 0.93-0.97 of the time it took with 64 x 128
# and no item steps, from 256 to 2048 tokens (docs/performance_cpu.md, "Forward per bucket").
_DEFAULT_BLOCKS = {"TPU v6 lite": (256, 256), "TPU v5 lite": (128, 512), "TPU v5": (128, 512),
                   "TPU v4": (128, 256), "xla cpu": (128, 128, 16, 32), "xla gpu": (512, 1024)}
_INTERPRET_BLOCKS = (16, 32)  # anything else runs the interpreter: keep grids small


def default_block_sizes(device_kind: str, page_size: int) -> BlockSizes:
    """`device_kind`: a TPU's, or "xla <platform>" for the planned XLA loop."""
    q_block, kv_block, *item = _DEFAULT_BLOCKS.get(device_kind, _INTERPRET_BLOCKS)
    whole_pages = lambda n: -(-n // page_size) * page_size  # noqa: E731
    item_sizes = (item[0], whole_pages(item[1])) if item else ()
    return BlockSizes(q_block, whole_pages(kv_block), *item_sizes)


class AttentionPlan(NamedTuple):
    token_pos: np.ndarray   # [T] KV position of each packed token (-1: padding)
    token_seq: np.ndarray   # [T] sequence of each packed token (-1: padding)
    step_block: np.ndarray  # [NS] q block of each grid step
    step_seq: np.ndarray    # [NS] sequence whose rows of the block the step serves
    step_kv: np.ndarray     # [NS] KV block (within its sequence) of each step
    step_flags: np.ndarray  # [NS] FIRST | LAST of its q block, NOOP for padding steps
    num_steps: np.ndarray   # [] int32, the real steps (a dynamic grid / loop bound)
    kv_split: np.ndarray | None = None  # [S] block steps see KV positions below it, item
    #                                      steps the rest (None: no item steps)
    items: "ItemSteps | None" = None


class ItemSteps(NamedTuple):
    block: np.ndarray      # [NI] item q block (of item_q_block tokens) of each step
    seq: np.ndarray        # [NI] sequence whose rows of the block the step serves
    start: np.ndarray      # [NI] first KV position of the step's window, page-aligned
    num_steps: np.ndarray  # [] int32, the real steps


def num_q_blocks(n_tokens: int, sizes: BlockSizes) -> int:
    return -(-n_tokens // sizes.q_block)


def max_plan_steps(n_tokens: int, n_seqs: int, kv_len: int, sizes: BlockSizes) -> int:
    """An upper bound on the steps of any batch within these limits: each sequence start may
    split a q block into one segment more, and a segment visits at most all KV blocks of its
    sequence."""
    segments = num_q_blocks(n_tokens, sizes) + max(n_seqs - 1, 0)
    return segments * -(-kv_len // sizes.kv_block)


def max_item_steps(n_tokens: int, n_seqs: int, page_size: int, sizes: BlockSizes) -> int:
    """An upper bound on the item steps of any batch: a segment's rows are consecutive
    positions whose items see at most item_kv_block of them, so its window spans at most
    item_q_block + item_kv_block - 1 positions, and page alignment adds page_size - 1."""
    if not sizes.item_q_block:
        return 0
    segments = -(-n_tokens // sizes.item_q_block) + max(n_seqs - 1, 0)
    span = sizes.item_q_block + sizes.item_kv_block + page_size - 2
    return segments * -(-span // sizes.item_kv_block)


def visited_kv_blocks(plan: AttentionPlan) -> int:
    """KV blocks the kernel copies and multiplies (padding steps excluded)."""
    return int(np.sum((np.asarray(plan.step_flags) & NOOP) == 0))


def real_q_blocks(plan: AttentionPlan) -> int:
    """q blocks that hold a real row (blocks of padding only have no step)."""
    real = (np.asarray(plan.step_flags) & NOOP) == 0
    return len(np.unique(np.asarray(plan.step_block)[real]))


def _token_rows(cu: np.ndarray, kv_lens: np.ndarray,
                n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(KV position, sequence) of each packed token; -1 for padding tokens."""
    t = np.arange(n_tokens)
    real = t < cu[-1]
    seq = np.where(real, np.searchsorted(cu, t, side="right") - 1, -1)
    s = np.maximum(seq, 0)
    pos = np.where(real, kv_lens[s] - cu[s + 1] + t, -1)
    return pos.astype(np.int32), seq.astype(np.int32)


def _segments(seq: np.ndarray, q_block: int) -> np.ndarray:
    """First token of each (q block, sequence) segment of the real tokens `seq`."""
    t = np.arange(len(seq))
    new = np.ones(len(seq), bool)
    new[1:] = (t[1:] // q_block != t[:-1] // q_block) | (seq[1:] != seq[:-1])
    return np.flatnonzero(new)


def _expand(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranges [start, start + count), concatenated: (range index, value) per element."""
    which = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return which, starts[which] + offset


def _kv_splits(pos, vis, seq, shared_lens, kv_lens, sizes: BlockSizes) -> np.ndarray:
    """Where each sequence's block steps stop: its query's L if item steps can take the
    positions past it, each row seeing at most item_kv_block of them, and they lie past the
    KV block the query ends in (a block the item rows visit anyway); else its kv_len."""
    past_query = np.zeros(len(kv_lens), np.int64)
    np.maximum.at(past_query, seq, pos - np.maximum(vis, shared_lens[seq]) + 1)
    query_blocks_end = -(-shared_lens // sizes.kv_block) * sizes.kv_block
    items = ((sizes.item_q_block > 0) & (shared_lens > 0)
             & (past_query <= sizes.item_kv_block) & (kv_lens > query_blocks_end))
    return np.where(items, shared_lens, kv_lens).astype(np.int32)


def _kv_block_steps(pos, vis, seq, shared_lens, splits, sizes: BlockSizes) -> np.ndarray:
    """[steps, 3] (q block, sequence, KV block): per segment, the KV blocks some row sees
    (the rule `sees` on intervals: a row sees [0, min(L, pos + 1)) and [vis, pos]) that lie
    below its sequence's split, ascending."""
    first = _segments(seq, sizes.q_block)
    s, kvb = seq[first], sizes.kv_block
    p_max, a_min = np.maximum.reduceat(pos, first), np.minimum.reduceat(vis, first)
    shared_end = -(-np.minimum(shared_lens[s], p_max + 1) // kvb)  # blocks [0, shared_end)
    lo, hi = a_min // kvb, p_max // kvb + 1                         # and [lo, hi)
    merged = lo <= shared_end
    limit = -(-splits[s] // kvb)
    starts = np.stack([np.zeros_like(lo), lo], 1).ravel()
    ends = np.stack([np.where(merged, np.maximum(shared_end, hi), shared_end),
                     np.where(merged, lo, hi)], 1).ravel()
    counts = np.maximum(np.minimum(ends, np.repeat(limit, 2)) - starts, 0)
    which, kv = _expand(starts, counts)
    segment = which // 2
    return np.stack([first[segment] // sizes.q_block, s[segment], kv], 1)


def _item_window_steps(pos, vis, seq, splits, sizes: BlockSizes, page_size: int) -> np.ndarray:
    """[steps, 3] (item q block, sequence, window start): per segment of item_q_block tokens,
    windows of item_kv_block positions from the first position past the split some row sees,
    page-aligned, to the last."""
    first = _segments(seq, sizes.item_q_block)
    split = splits[seq]
    past = pos >= split
    lo = np.minimum.reduceat(np.where(past, np.maximum(vis, split), np.iinfo(np.int32).max),
                             first)
    hi = np.maximum.reduceat(np.where(past, pos, -1), first)
    lo = lo // page_size * page_size
    counts = np.where(hi >= 0, -(-(hi + 1 - lo) // sizes.item_kv_block), 0)
    which, k = _expand(np.zeros_like(lo), counts)
    return np.stack([first[which] // sizes.item_q_block, seq[first[which]],
                     lo[which] + k * sizes.item_kv_block], 1)


def build_plan(cu_q_lens, kv_lens, shared_lens, visible_from, sizes: BlockSizes,
               max_steps: int | None = None, *, page_size: int = 0,
               max_item_steps: int | None = None) -> AttentionPlan:
    """Pads the steps to `max_steps` and the item steps to `max_item_steps` (None: no
    padding). Item steps, where `sizes` has them, need the `page_size`. Array operations
    throughout: its cost follows the tokens and steps, with no Python loop over them."""
    if sizes.item_q_block:
        sizes.check(page_size)
    cu, kv_lens, shared_lens, visible_from = (np.asarray(x, np.int64) for x in (
        cu_q_lens, kv_lens, shared_lens, visible_from))
    pos, seq = _token_rows(cu, kv_lens, len(visible_from))
    n = int(cu[-1])
    real = (pos[:n].astype(np.int64), visible_from[:n], seq[:n])
    splits = _kv_splits(*real, shared_lens, kv_lens, sizes)
    steps = _kv_block_steps(*real, shared_lens, splits, sizes) if n else np.zeros((0, 3))
    plan = _block_steps(pos, seq, steps, max_steps)
    if not sizes.item_q_block:
        return plan
    items = _item_window_steps(*real, splits, sizes, page_size) if n else np.zeros((0, 3))
    return plan._replace(kv_split=splits, items=_item_steps(items, max_item_steps))


def _block_flags(blocks: np.ndarray) -> np.ndarray:
    first = np.r_[True, blocks[1:] != blocks[:-1]]
    last = np.r_[blocks[1:] != blocks[:-1], True]
    return (FIRST * first | LAST * last).astype(np.int32)


def _block_steps(pos, seq, steps: np.ndarray, max_steps: int | None) -> AttentionPlan:
    n_real = len(steps)
    n_steps = _padded_size(n_real, max_steps, "steps")
    table = np.asarray(steps if n_real else [(0, 0, 0)], np.int32).reshape(-1, 3)
    flags = _block_flags(table[:, 0]) if n_real else np.array([NOOP], np.int32)
    pad = n_steps - len(table)
    table = np.concatenate([table, np.repeat(table[-1:], pad, axis=0)])
    flags = np.concatenate([flags, np.full(pad, NOOP, np.int32)])
    return AttentionPlan(token_pos=pos, token_seq=seq, step_block=table[:, 0],
                         step_seq=table[:, 1], step_kv=table[:, 2], step_flags=flags,
                         num_steps=np.int32(max(n_real, 1)))


def _item_steps(steps: np.ndarray, max_steps: int | None) -> ItemSteps:
    table = np.asarray(steps if len(steps) else [(0, 0, 0)], np.int32).reshape(-1, 3)
    pad = _padded_size(len(steps), max_steps, "item steps") - len(table)
    table = np.concatenate([table, np.repeat(table[-1:], pad, axis=0)])
    return ItemSteps(block=table[:, 0], seq=table[:, 1], start=table[:, 2],
                     num_steps=np.int32(len(steps)))


def _padded_size(n: int, limit: int | None, what: str) -> int:
    if limit is None:
        return max(n, 1)
    if n > limit:
        raise ValueError(f"the plan has {n} {what}, more than the {limit} it is padded to")
    return limit
