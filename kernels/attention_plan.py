"""The block plan the ragged paged attention kernels walk, in array operations of static
shape: a program builds it on the devices from the batch's metadata (`plan_attention`), so
the host sends a few numbers a sequence, not the steps.

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

A sliding window W (a plan for a model's windowed layers) narrows what a row sees to the keys
within W of it by logical position (CONTRACT §4): the shared blocks from the row's
`p - max(vis - L, 0) - W + 1`, its own from `p - W + 1`; a segment's steps start at the least
of its rows' bounds, so a KV block that the window hides from every row is absent too.

Tiles (the Pallas kernel's, where the block sizes name one): a step's q block and KV block
are cut into tiles of `tile` rows and keys, and each step carries a bit per tile that some row
of its segment sees a key of; the kernel skips the others. Items' rows see the query and
their own item, so most of a block's tiles are masked whole.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FIRST, LAST, NOOP = 1, 2, 4  # step flags


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    q_block: int = 32       # query tokens per block
    kv_block: int = 128     # KV positions per block, a multiple of the page size
    item_q_block: int = 0   # query tokens per item step (0: no item steps)
    item_kv_block: int = 0  # KV positions per item window, a multiple of the page size
    tile: int = 0           # rows and keys of the tiles a kernel step skips where no row sees
    #                         a key (0: none), dividing both blocks, a multiple of the page size

    def check(self, page_size: int) -> None:
        if (self.q_block % 8 or self.kv_block % page_size or self.item_q_block % 8
                or self.item_kv_block % page_size
                or (self.item_q_block > 0) != (self.item_kv_block > 0)):
            raise ValueError(f"{self}: q blocks must be multiples of 8, KV blocks multiples "
                             f"of the page size {page_size}, and item steps need both sizes")
        if self.tile and (self.q_block % self.tile or self.kv_block % self.tile
                          or self.tile % page_size or self.tile % 8):
            raise ValueError(f"{self}: a tile must divide both blocks and be a multiple of 8 "
                             f"and of the page size {page_size}")

    def with_blocks(self, q_block: int, kv_block: int) -> "BlockSizes":
        """These sizes with other blocks, and the tile where it still divides them."""
        tile = self.tile if self.tile and q_block % self.tile == kv_block % self.tile == 0 else 0
        return dataclasses.replace(self, q_block=q_block, kv_block=kv_block, tile=tile)

    def tiles(self) -> tuple[int, int]:
        """Tiles of a step: (along its q block, along its KV block)."""
        if not self.tile:
            return 1, 1
        return self.q_block // self.tile, self.kv_block // self.tile


# Block sizes by TPU kind: VMEM use stays a few MiB for head_dim 128 and 8 KV heads. On v6e,
# 256/512 (estimated from the compiled schedule by the model calibrated on real v6e
# measurements, a model): a grid step costs 0.27 us beyond its bundles, and KV blocks of 512
# take a 300-token SGLang sequence in one step, 14 steps at 2048 tokens where 256/256 took 21
# (Qwen3-0.6B's forward 4.289 ms against 4.328; 512/512 4.286, but at 128 tokens, whose q
# block it pads to 512, 5% slower than 256/512, itself 1.5% slower than 256/256 there;
# docs/tpu_v6e.md, "The layer after attention in one kernel"). Its steps skip tiles of
# 128 x 128 that no row sees: on SGLang's shape half of a step's tiles (docs/tpu_v6e.md,
# "Tiles a step skips").
# The planned XLA loop, by platform: on a GPU each step costs some 60 us of launches and a
# loop test read back by the host, whatever its size, so steps there are few and large. On
# CPU, item steps of 16 x 32 take the items off the q blocks of 128 x 128, which then see the
# query only: a forward on SGLang's shape takes 0.93-0.97 of the time it took with 64 x 128
# and no item steps, from 256 to 2048 tokens (docs/performance_cpu.md, "Forward per bucket").
_DEFAULT_BLOCKS = {"TPU v6 lite": BlockSizes(256, 512, tile=128),
                   "TPU v5 lite": BlockSizes(128, 512), "TPU v5": BlockSizes(128, 512),
                   "TPU v4": BlockSizes(128, 256), "xla cpu": BlockSizes(128, 128, 16, 32),
                   "xla gpu": BlockSizes(512, 1024)}
_INTERPRET_BLOCKS = BlockSizes(16, 32)  # anything else runs the interpreter: keep grids small


def default_block_sizes(device_kind: str, page_size: int) -> BlockSizes:
    """`device_kind`: a TPU's, or "xla <platform>" for the planned XLA loop. KV sizes are
    rounded up to whole pages; a tile that is not whole pages is dropped."""
    sizes = _DEFAULT_BLOCKS.get(device_kind, _INTERPRET_BLOCKS)
    whole_pages = lambda n: -(-n // page_size) * page_size  # noqa: E731
    return dataclasses.replace(sizes, kv_block=whole_pages(sizes.kv_block),
                               item_kv_block=whole_pages(sizes.item_kv_block),
                               tile=sizes.tile if sizes.tile % page_size == 0 else 0)


class AttentionPlan(NamedTuple):
    token_pos: jax.Array    # [T] KV position of each packed token (-1: padding)
    token_seq: jax.Array    # [T] sequence of each packed token (-1: padding)
    step_block: jax.Array   # [NS] q block of each grid step
    step_seq: jax.Array     # [NS] sequence whose rows of the block the step serves
    step_kv: jax.Array      # [NS] KV block (within its sequence) of each step
    step_flags: jax.Array   # [NS] FIRST | LAST of its q block, NOOP for padding steps
    num_steps: jax.Array    # [] int32, the real steps (a dynamic grid / loop bound)
    kv_split: jax.Array | None = None  # [S] block steps see KV positions below it, item
    #                                     steps the rest (None: no item steps)
    items: "ItemSteps | None" = None
    step_tiles: jax.Array | None = None  # [NS] bit r x (KV block's tiles) + c set where tile
    #                                       (r, c) of the step has a row that sees a key


class ItemSteps(NamedTuple):
    block: jax.Array       # [NI] item q block (of item_q_block tokens) of each step
    seq: jax.Array         # [NI] sequence whose rows of the block the step serves
    start: jax.Array       # [NI] first KV position of the step's window, page-aligned
    num_steps: jax.Array   # [] int32, the real steps


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


def visited_tiles(plan: AttentionPlan, sizes: BlockSizes) -> list[int]:
    """Per tile of a step (bit r x KV tiles + c), the real steps that compute it; none for a
    plan without tiles, whose steps compute their whole blocks."""
    if plan.step_tiles is None:
        return []
    bits = np.asarray(plan.step_tiles)[(np.asarray(plan.step_flags) & NOOP) == 0]
    return [int(np.sum((bits >> j) & 1)) for j in range(int(np.prod(sizes.tiles())))]


def live_tile_share(plan: AttentionPlan, sizes: BlockSizes) -> float:
    """The share of the real steps' tiles that they compute (1 without tiles)."""
    tiles, steps = visited_tiles(plan, sizes), visited_kv_blocks(plan)
    return sum(tiles) / (steps * len(tiles)) if tiles and steps else 1.0


def real_q_blocks(plan: AttentionPlan) -> int:
    """q blocks that hold a real row (blocks of padding only have no step)."""
    real = (np.asarray(plan.step_flags) & NOOP) == 0
    return len(np.unique(np.asarray(plan.step_block)[real]))


def _ceil_div(a, b: int):
    return -(-a // b)


def _token_rows(cu, kv_lens, n_tokens: int):
    """(KV position, sequence) of each packed token; -1 for padding tokens."""
    t = jnp.arange(n_tokens, dtype=jnp.int32)
    real = t < cu[-1]
    # A token's sequence: how many offsets lie at or below it (S + 1 compares a token).
    seq = jnp.searchsorted(cu, t, side="right", method="compare_all").astype(jnp.int32) - 1
    s = jnp.clip(seq, 0, len(kv_lens) - 1)
    pos = jnp.where(real, _lookup(kv_lens - cu[1:], s) + t, -1)
    return pos, jnp.where(real, seq, -1)


def _lookup(table, index):
    """table[index] for a short table and many indices, as compares and a sum: a gather of
    one element a token costs TPU programs some 5 bundles an element (docs/tpu_v6e.md)."""
    hit = index[:, None] == jnp.arange(len(table), dtype=index.dtype)
    return jnp.sum(jnp.where(hit, table, 0), axis=1, dtype=table.dtype)


class _Segments(NamedTuple):
    """The (block, sequence) pieces of the real tokens, padded to a bound. A reduction over
    each is a masked one over the tokens: no scan (a log-depth scan of pairs took a second
    of XLA's CPU compile each)."""
    first: jax.Array   # [size] each segment's first token
    last: jax.Array    # [size] and its last (padding segments: an empty or any range)
    seq: jax.Array     # [size] and its sequence
    count: jax.Array   # [] real segments

    @property
    def real(self):
        return jnp.arange(len(self.first)) < self.count

    def reduce(self, op, x, fill, where=True):
        """`op` (jnp.min or jnp.max) of `x` over each segment's tokens (those `where` holds):
        over every token, masked (a gather of each segment's block row cost TPU programs more
        than the compares)."""
        t = jnp.arange(len(x), dtype=jnp.int32)
        inside = (t >= self.first[:, None]) & (t <= self.last[:, None]) & where
        return op(jnp.where(inside, x, fill), axis=1)


def _segments(cu, seq, block: int) -> _Segments:
    """A segment begins at each block start and each sequence start within the real tokens
    (a prefix), so the starts are the sorted union of two short lists: each start's place is
    its count of smaller ones (no cumulative sum over the tokens: a scan, slow to compile).
    At most one a block and one more a sequence start within a block."""
    n_tokens = len(seq)
    n_blocks, n_real = _ceil_div(n_tokens, block), cu[-1]
    candidates = jnp.concatenate([jnp.arange(n_blocks, dtype=jnp.int32) * block, cu[:-1]])
    block_start = jnp.arange(len(candidates)) < n_blocks
    valid = jnp.where(block_start, candidates < n_real,
                      (jnp.pad(cu[1:], (n_blocks, 0)) > candidates) & (candidates % block != 0))
    starts = jnp.where(valid, candidates, n_tokens)
    place = jnp.sum(starts[None, :] < starts[:, None], axis=1)
    k = jnp.arange(n_blocks + max(len(cu) - 2, 0), dtype=jnp.int32)  # the bound: one start less
    first = jnp.sum(jnp.where(valid & (place == k[:, None]), starts, 0), axis=1)
    count = jnp.sum(valid, dtype=jnp.int32)
    last = jnp.where(k + 1 < count, jnp.roll(first, -1) - 1, n_real - 1)
    return _Segments(first.astype(jnp.int32), jnp.clip(last, 0, n_tokens - 1),
                     jnp.maximum(seq[first], 0), count)


def expand_ranges(starts, counts, size: int):
    """The ranges [start, start + count), concatenated and padded to `size` by repeating the
    last element: (range index, value) per element, and the real elements' count. The ranges
    are few: their ends are sums under a triangle, not a scan."""
    j = jnp.arange(len(counts))
    ends = jnp.sum(jnp.where(j <= j[:, None], counts, 0), axis=1, dtype=jnp.int32)
    total = jnp.sum(counts, dtype=jnp.int32)
    j = jnp.minimum(jnp.arange(size, dtype=jnp.int32), jnp.maximum(total - 1, 0))
    which = jnp.searchsorted(ends, j, side="right", method="compare_all").astype(jnp.int32)
    which = jnp.minimum(which, len(counts) - 1)
    return which, j + _lookup(starts - ends + counts, which), total


def _kv_splits(pos, vis, seq, real, seg: _Segments, shared_lens, kv_lens,
               sizes: BlockSizes):
    """Where each sequence's block steps stop: its query's L if item steps can take the
    positions past it, each row seeing at most item_kv_block of them, and they lie past the
    KV block the query ends in (a block the item rows visit anyway); else its kv_len."""
    s = jnp.maximum(seq, 0)
    past = jnp.where(real, pos - jnp.maximum(vis, _lookup(shared_lens, s)) + 1, 0)
    of_seq = (seg.seq == jnp.arange(len(shared_lens))[:, None]) & seg.real  # [S, segments]
    past_query = jnp.max(jnp.where(of_seq, seg.reduce(jnp.max, past, 0), 0), axis=1)
    query_blocks_end = _ceil_div(shared_lens, sizes.kv_block) * sizes.kv_block
    items = ((sizes.item_q_block > 0) & (shared_lens > 0)
             & (past_query <= sizes.item_kv_block) & (kv_lens > query_blocks_end))
    return jnp.where(items, shared_lens, kv_lens).astype(jnp.int32)


def _logical_pos(pos, vis, seq, shared_lens):
    """Each token's position as if its item followed the query directly: p - max(vis - L, 0)
    (`kernels.ragged_paged_attention.logical_distance`)."""
    return pos - jnp.maximum(vis - _lookup(shared_lens, jnp.maximum(seq, 0)), 0)


def _kv_block_steps(pos, vis, logical, seg: _Segments, shared_lens, splits,
                    sizes: BlockSizes, max_steps: int, window: int):
    """(q block, sequence, KV block) of each step, its segment, and the real steps' count:
    per segment, the KV blocks some row sees (the rule `sees` on intervals: a row sees
    [0, min(L, pos + 1)) and [vis, pos], with a `window` [logical - W + 1, L) and
    [pos - W + 1, pos] of them) that lie below its sequence's split, ascending."""
    first, s = seg.first, seg.seq
    p_max = pos[seg.last]  # positions rise within a segment
    never = jnp.iinfo(jnp.int32).max
    a_min = seg.reduce(jnp.min, vis, never)
    kvb = sizes.kv_block
    shared_stop, shared_start = jnp.minimum(shared_lens[s], p_max + 1), jnp.zeros_like(p_max)
    own_start = a_min
    if window:
        shared_start = jnp.maximum(seg.reduce(jnp.min, logical, never) - window + 1, 0)
        own_start = jnp.maximum(a_min, pos[first] - window + 1)  # positions rise
    seen = shared_start < shared_stop
    shared_from = jnp.where(seen, shared_start // kvb, 0)              # blocks [from, end)
    shared_end = jnp.where(seen, _ceil_div(shared_stop, kvb), 0)
    lo, hi = own_start // kvb, p_max // kvb + 1                        # and [lo, hi)
    merged = lo <= shared_end
    limit = _ceil_div(splits[s], kvb)
    starts = jnp.stack([jnp.where(merged, jnp.minimum(shared_from, lo), shared_from), lo],
                       1).ravel()
    ends = jnp.stack([jnp.where(merged, jnp.maximum(shared_end, hi), shared_end),
                      jnp.where(merged, lo, hi)], 1).ravel()
    valid = jnp.repeat(seg.real, 2)
    counts = jnp.where(valid, jnp.maximum(jnp.minimum(ends, jnp.repeat(limit, 2)) - starts, 0),
                       0)
    which, kv, total = expand_ranges(starts, counts, max_steps)
    segment = which // 2
    return _or_zeros(total, _lookup(first // sizes.q_block, segment), _lookup(s, segment),
                     kv), segment, total


def _step_tiles(pos, vis, logical, seg: _Segments, segment, step_seq, step_kv, shared_lens,
                sizes: BlockSizes, window: int):
    """Each step's tiles that some row sees a key of, as bits: tile (r, c) holds the
    segment's rows of the r-th tile of its q block and the c-th tile of its KV block. A row
    at p sees keys [k0, min(k1, p)] of a tile [k0, k1] where p >= k0 and k0 < L or
    min(k1, p) >= its vis, and (a `window`) k1 > its logical position - W; a tile's rows are
    tested by their largest p, smallest vis and smallest logical position (a tile that
    passes may still see nothing; one that fails sees nothing)."""
    n_rows, n_keys = sizes.tiles()
    t = jnp.arange(len(pos), dtype=jnp.int32)
    tile_row = t % sizes.q_block // sizes.tile
    shared = _lookup(shared_lens, step_seq)
    bits, never = jnp.zeros_like(step_kv), jnp.iinfo(jnp.int32).max
    for r in range(n_rows):
        rows = tile_row == r
        p_max = _lookup(seg.reduce(jnp.max, pos, -1, rows), segment)
        vis_min = _lookup(seg.reduce(jnp.min, vis, never, rows), segment)
        near = _lookup(seg.reduce(jnp.min, logical, never, rows), segment) - window
        for c in range(n_keys):
            k0 = step_kv * sizes.kv_block + c * sizes.tile
            k1 = k0 + sizes.tile - 1
            sees = (p_max >= k0) & ((k0 < shared) | (jnp.minimum(k1, p_max) >= vis_min))
            if window:
                sees = sees & (k1 > near)
            bits = bits | jnp.where(sees, 1 << (r * n_keys + c), 0)
    return bits.astype(jnp.int32)


def _item_window_steps(pos, vis, seq, real, seg: _Segments, splits, sizes: BlockSizes,
                       page_size: int, max_steps: int):
    """(item q block, sequence, window start) of each item step, and the real ones' count:
    per segment of item_q_block tokens, windows of item_kv_block positions from the first
    position past the split some row sees, page-aligned, to the last."""
    first, s = seg.first, seg.seq
    split = splits[jnp.maximum(seq, 0)]
    past = real & (pos >= split)
    never = jnp.iinfo(jnp.int32).max
    lo = seg.reduce(jnp.min, jnp.where(past, jnp.maximum(vis, split), never), never)
    hi = jnp.where(past[seg.last], pos[seg.last], -1)  # past the split: a segment's tail
    lo = lo // page_size * page_size
    valid = seg.real & (hi >= 0)
    counts = jnp.where(valid, _ceil_div(hi + 1 - lo, sizes.item_kv_block), 0)
    which, k, total = expand_ranges(jnp.zeros_like(lo), counts, max_steps)
    return _or_zeros(total, _lookup(first // sizes.item_q_block, which), _lookup(s, which),
                     _lookup(lo, which) + k * sizes.item_kv_block), total


def _or_zeros(total, *fields):
    """A plan without a real step is all zeros (each step a NOOP)."""
    return tuple(jnp.where(total == 0, 0, f).astype(jnp.int32) for f in fields)


def _block_flags(blocks, total):
    """FIRST | LAST of its q block for the real steps, NOOP for the padding."""
    j = jnp.arange(len(blocks))
    first = (j == 0) | (blocks != jnp.roll(blocks, 1))
    last = (j == total - 1) | (blocks != jnp.roll(blocks, -1))
    flags = FIRST * first.astype(jnp.int32) | LAST * last.astype(jnp.int32)
    return jnp.where(j < total, flags, NOOP).astype(jnp.int32)


def _plan(cu, kv_lens, shared_lens, visible_from, *, sizes: BlockSizes, max_steps: int,
          page_size: int, max_item_steps: int, window: int = 0):
    """The plan, padded to the bounds, and the steps and item steps it needs; `window`: of
    the layers it serves (0: none)."""
    cu, kv_lens, shared_lens, vis = (jnp.asarray(x, jnp.int32) for x in (
        cu, kv_lens, shared_lens, visible_from))
    pos, seq = _token_rows(cu, kv_lens, len(vis))
    real = seq >= 0
    args = (pos, vis, seq, real)
    seg = _segments(cu, seq, sizes.q_block)
    splits = _kv_splits(*args, seg, shared_lens, kv_lens, sizes)
    logical = _logical_pos(pos, vis, seq, shared_lens)
    (block, step_seq, kv), segment, total = _kv_block_steps(
        pos, vis, logical, seg, shared_lens, splits, sizes, max_steps, window)
    plan = AttentionPlan(token_pos=pos, token_seq=seq, step_block=block.astype(jnp.int32),
                         step_seq=step_seq.astype(jnp.int32), step_kv=kv.astype(jnp.int32),
                         step_flags=_block_flags(block, total),
                         num_steps=jnp.clip(total, 1, max_steps).astype(jnp.int32))
    if sizes.tile:
        plan = plan._replace(step_tiles=_step_tiles(pos, vis, logical, seg, segment,
                                                    plan.step_seq, plan.step_kv, shared_lens,
                                                    sizes, window))
    if not sizes.item_q_block:
        return plan, total, jnp.int32(0)
    (i_block, i_seq, start), i_total = _item_window_steps(
        *args, _segments(cu, seq, sizes.item_q_block), splits, sizes, page_size, max_item_steps)
    items = ItemSteps(block=i_block.astype(jnp.int32), seq=i_seq.astype(jnp.int32),
                      start=start.astype(jnp.int32),
                      num_steps=jnp.minimum(i_total, max_item_steps).astype(jnp.int32))
    return plan._replace(kv_split=splits, items=items), total, i_total


# Programs trace `_plan` inline: as a nested jit's call, two v6e programs compiling at once
# crashed the TPU compiler (a segmentation fault, 3 of 3 tries, this jax and libtpu).
_plan_program = jax.jit(_plan, static_argnames=("sizes", "max_steps", "page_size",
                                               "max_item_steps", "window"))


def _bounds(n_tokens: int, n_seqs: int, kv_len: int, sizes: BlockSizes, page_size: int):
    return (max(max_plan_steps(n_tokens, n_seqs, kv_len, sizes), 1),
            max(max_item_steps(n_tokens, n_seqs, page_size, sizes), 1))


def plan_attention(md, sizes: BlockSizes, page_size: int, window: int = 0):
    """The AttentionMetadata `md` with its plan, built where it is called (inside a program:
    on the devices), padded to the bounds of its shapes: any batch they hold fits them. With
    a `window`, also `window_plan`, the plan of the layers with that window (or a smaller)."""
    if sizes.item_q_block:
        sizes.check(page_size)
    n_seqs, pages_per_seq = md.page_indices.shape
    max_steps, max_items = _bounds(len(md.visible_from), n_seqs, pages_per_seq * page_size,
                                   sizes, page_size)
    def plan(w: int) -> AttentionPlan:
        return _plan(md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, sizes=sizes,
                     max_steps=max_steps, page_size=page_size, max_item_steps=max_items,
                     window=w)[0]

    return md._replace(plan=plan(0), window_plan=plan(window) if window else None)


def host_plan(md, sizes: BlockSizes, page_size: int, window: int = 0) -> AttentionPlan:
    """The plan a program builds from concrete metadata `md` (`plan_attention`), as NumPy
    arrays: for studies and tests; with a `window`, the windowed layers'."""
    planned = _planned(md, sizes, page_size, window)
    return jax.tree.map(np.asarray, planned.window_plan if window else planned.plan)


_planned = jax.jit(plan_attention, static_argnums=(1, 2, 3))


def build_plan(cu_q_lens, kv_lens, shared_lens, visible_from, sizes: BlockSizes,
               max_steps: int | None = None, *, page_size: int = 0,
               max_item_steps: int | None = None, window: int = 0) -> AttentionPlan:
    """The plan of concrete metadata (studies and tests), its steps padded to `max_steps`
    and its item steps to `max_item_steps` (None: the bounds of its shapes and longest
    sequence); a plan that does not fit them raises. Item steps, where `sizes` has them,
    need the `page_size`; `window`: the layers' sliding window (0: none). NumPy arrays."""
    if sizes.item_q_block:
        sizes.check(page_size)
    bounds = _bounds(len(visible_from), len(kv_lens), int(np.max(kv_lens, initial=0)), sizes,
                     page_size)
    max_steps = bounds[0] if max_steps is None else max_steps
    max_items = bounds[1] if max_item_steps is None else max_item_steps
    plan, needed, needed_items = _plan_program(cu_q_lens, kv_lens, shared_lens, visible_from,
                                       sizes=sizes, max_steps=max_steps, page_size=page_size,
                                       max_item_steps=max(max_items, 1), window=window)
    for n, limit, what in ((needed, max_steps, "steps"), (needed_items, max_items, "item steps")):
        if int(n) > limit:
            raise ValueError(f"the plan has {int(n)} {what}, more than the {limit} it is "
                             f"padded to")
    return jax.tree.map(np.asarray, plan)
