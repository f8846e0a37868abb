"""Ragged paged attention with the multi-item mask: the Pallas TPU kernel.

Same semantics as `ragged_paged_attention_reference`. The grid walks the steps of an
AttentionPlan: one (q block, sequence, visible KV block) triple per step. q and the output
are [tokens, heads x head_dim], the projections' own layout, so nothing gathers or transposes
them around the kernel; a KV head's rows are its group's lane slices of a q block. KV pages
stay in HBM and are copied page by page into a two-slot VMEM buffer, the next step's pages in
flight while the current step computes. Page tables, lengths and the plan live in SMEM
(scalar prefetch). The online softmax (max, sum, accumulator) is float32, one KV head at a
time, its GQA group of query heads stacked as rows. Scores are laid out keys by rows
([kv_block, rows]): the reductions over keys then run across vregs and sublanes instead of
across lanes, which in the compiled v6e schedule cut a step by a fifth; and the next two
heads' scores are computed before a head's softmax, which cut it by a fifth again
(profiling.v6e.schedule; docs/tpu_v6e.md). Where the block sizes name a tile, a step runs
as tiles of tile rows x tile keys and skips those the plan marks as seen by no row: on
SGLang's shape half of them, whose softmax was most of a step (docs/tpu_v6e.md, "Tiles a
step skips").
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.attention_plan import FIRST, LAST, NOOP, AttentionPlan, BlockSizes, num_q_blocks
from kernels.ragged_paged_attention import (
    MASKED,
    AttentionMetadata,
    check_attention_shapes,
    sees,
    soft_capped,
)

_SCORES_AHEAD = 2  # KV heads whose scores are computed ahead of a head's softmax


@dataclasses.dataclass(frozen=True)
class _KvCopies:
    """A step's KV block, K and V, into a slot of the two-slot VMEM buffers: one copy each
    where the pages that hold the sequence's keys in it follow each other in the pool (the
    copy reads on to the block's end: keys past the sequence are masked; `whole_blocks`),
    else a copy a page. A step of pages of 16 issues 32 DMAs otherwise, whose starts the
    compiler puts in a block of their own (docs/tpu_v6e.md, "Whole blocks of pages in one
    copy")."""
    layer_ref: object
    step_seq_ref: object
    step_kv_ref: object
    pages_ref: object
    whole_ref: object  # SMEM: whether a sequence's KV block comes in one copy (whole_blocks)
    k_hbm: object
    v_hbm: object
    k_buf: object
    v_buf: object
    sems: object
    pages_per_seq: int
    pages_per_block: int

    def _first_page(self, step):
        return (self.step_seq_ref[step] * self.pages_per_seq
                + self.step_kv_ref[step] * self.pages_per_block)

    def _copies(self, step, slot, whole: bool) -> list:
        base, layer = self._first_page(step), self.layer_ref[0]
        pairs = ((self.k_hbm, self.k_buf), (self.v_hbm, self.v_buf))
        if whole:
            first = self.pages_ref[base]
            return [pltpu.make_async_copy(src.at[layer, :, pl.ds(first, self.pages_per_block)],
                                          dst.at[slot], self.sems.at[n, slot])
                    for n, (src, dst) in enumerate(pairs)]
        return [pltpu.make_async_copy(src.at[layer, :, self.pages_ref[base + j]],
                                      dst.at[slot, :, j], self.sems.at[n, slot])
                for j in range(self.pages_per_block) for n, (src, dst) in enumerate(pairs)]

    def start(self, step, slot) -> None:
        self._each(step, slot, lambda c: c.start())

    def wait(self, step, slot) -> None:
        self._each(step, slot, lambda c: c.wait())

    def _each(self, step, slot, act) -> None:
        block = (self.step_seq_ref[step] * (self.pages_per_seq // self.pages_per_block)
                 + self.step_kv_ref[step])
        whole = self.whole_ref[block] != 0
        for taken in (True, False):
            @pl.when(whole == taken)
            def _():
                for c in self._copies(step, slot, taken):
                    act(c)


def _mask_bias(first_key, kv_block, pos, vis, shared_len, kv_len, window=None):
    """[kv_block, rows]: 0 where the row (at KV position `pos`, seeing the query and keys from
    `vis` on) sees the key, MASKED elsewhere: the multi-item mask, and the layer's sliding
    window by logical position where the model has windows."""
    col = first_key + jax.lax.broadcasted_iota(jnp.int32, (kv_block, pos.shape[1]), 0)
    return jnp.where(sees(col, pos, vis, shared_len, kv_len, window), 0.0, MASKED)


@dataclasses.dataclass(frozen=True)
class _Scale:
    """What scores are scaled by: sm_scale, then (Gemma 2) soft-capped, then log2(e), so that
    the softmax runs in base 2."""
    sm_scale: float
    softcap: float = 0.0

    def __call__(self, s):
        if not self.softcap:
            return s * (self.sm_scale * math.log2(math.e))
        return soft_capped(s * self.sm_scale, self.softcap) * math.log2(math.e)


def _scores(q, k, bias, scale: _Scale):
    """Keys on sublanes, rows on lanes: s is [kv_block, rows], so the max and the sum over
    keys are sums across vregs and sublanes (VPU), not across lanes."""
    return scale(jax.lax.dot_general(k, q, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)) + bias


def _online_softmax_update(s, v, m_ref, l_ref, acc_ref, at):
    """The running max, sum and accumulator of KV head and tile row `at`. A masked key's
    score is -1e30: a row that sees nothing yet sums junk at a running max near -1e30, which
    its first visible key rescales by exp2(-1e30 - max) = 0; a row that never sees a key is a
    padding row."""
    m_prev, l_prev = m_ref[at], l_ref[at]  # [1, rows]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next)
    l_ref[at] = alpha * l_prev + jnp.sum(p, axis=0, keepdims=True)
    m_ref[at] = m_next
    pv = jax.lax.dot_general(v, p.astype(v.dtype), (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [D, rows]
    acc_ref[at] = acc_ref[at] * alpha + pv


def _kv_heads(q_rows, group, k_all, v_all, bias, scale, r, m_ref, l_ref, acc_ref):
    """One tile over every KV head, the scores of the next _SCORES_AHEAD heads computed
    before this head's softmax: the heads are independent, and in the compiled schedule the
    MXU then works while the VPU does a softmax (docs/tpu_v6e.md, "Estimated on v6e from the
    compiled schedule"). `q_rows(j)`: query head j's rows of the tile."""
    n_heads, keys, d = k_all.shape[0], k_all.shape[1] * k_all.shape[2], k_all.shape[-1]

    def scores(h):  # the group's rows stacked: (g, token)
        q = jnp.concatenate([q_rows(j) for j in range(h * group, (h + 1) * group)])
        return _scores(q, k_all[h].reshape(keys, d), bias, scale)

    ahead = {h: scores(h) for h in range(min(_SCORES_AHEAD, n_heads))}
    for h in range(n_heads):
        if h + _SCORES_AHEAD < n_heads:
            ahead[h + _SCORES_AHEAD] = scores(h + _SCORES_AHEAD)
        _online_softmax_update(ahead.pop(h), v_all[h].reshape(keys, d), m_ref, l_ref,
                               acc_ref, (h, r))


def _tile(r, c, refs, slot, scale, window, *, tile_rows, tile_pages):
    """Tile (r, c) of the step: its q block's r-th tile of rows against its KV block's c-th
    tile of keys. `window`: the layer's (None: the model has none)."""
    (step_seq_ref, step_kv_ref, kv_lens_ref, shared_lens_ref, q_ref, pos_ref, seq_ref, vis_ref,
     k_buf, v_buf, m_ref, l_ref, acc_ref) = refs
    i, d = pl.program_id(0), k_buf.shape[-1]
    keys, group = tile_pages * k_buf.shape[3], m_ref.shape[-1] // tile_rows
    seq = step_seq_ref[i]
    pos = jnp.where(seq_ref[0, r:r + 1] == seq, pos_ref[0, r:r + 1], -1)  # other sequences see none
    first_key = step_kv_ref[i] * k_buf.shape[2] * k_buf.shape[3] + c * keys
    bias = _mask_bias(first_key, keys, pos, vis_ref[0, r:r + 1], shared_lens_ref[seq],
                      kv_lens_ref[seq], window)
    pages = slice(c * tile_pages, (c + 1) * tile_pages)
    # k_buf, v_buf [2, Hkv, pages_per_block, page, D]
    _kv_heads(lambda j: q_ref[r * tile_rows:(r + 1) * tile_rows, pl.ds(j * d, d)], group,
              k_buf[slot, :, pages], v_buf[slot, :, pages], bias, scale, r, m_ref, l_ref,
              acc_ref)


def _store_output(o_ref, l_ref, acc_ref, *, tile_rows):
    """The q block's output: rows of padding, which no tile of the block saw, are 0 (their
    accumulator may hold an earlier block's sums)."""
    n_heads, n_tiles, d = acc_ref.shape[:3]
    group = acc_ref.shape[-1] // tile_rows
    for r in range(n_tiles):
        l_r = l_ref[:, r]
        scale = jnp.where(l_r > 0, 1.0 / l_r, 0.0)  # [Hkv, 1, rows]; l >= 1 if seen
        # rounded before the transpose, which then moves half the vregs
        out = (acc_ref[:, r] * scale).astype(o_ref.dtype)  # [Hkv, D, rows]
        out = jnp.swapaxes(out, 1, 2)  # rows are (g, token)
        for j in range(n_heads * group):
            h, g = divmod(j, group)
            o_ref[r * tile_rows:(r + 1) * tile_rows, pl.ds(j * d, d)] = (
                out[h, g * tile_rows:(g + 1) * tile_rows])


def _kernel(layer_ref, step_block_ref, step_seq_ref, step_kv_ref, step_flags_ref,
            step_tiles_ref, pages_ref, whole_ref, kv_lens_ref, shared_lens_ref,
            q_ref, pos_ref, seq_ref, vis_ref, k_hbm, v_hbm,
            o_ref,
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref,
            *, scale: _Scale, windowed: bool, pages_per_seq, pages_per_block, tiles):
    i, n = pl.program_id(0), pl.num_programs(0)
    del step_block_ref  # read by the index maps
    copies = _KvCopies(layer_ref, step_seq_ref, step_kv_ref, pages_ref, whole_ref, k_hbm,
                       v_hbm, k_buf, v_buf, sems, pages_per_seq, pages_per_block)
    flags = step_flags_ref[i]
    active = (flags & NOOP) == 0
    nxt = jnp.minimum(i + 1, n - 1)
    n_rows, n_keys = tiles
    tile_rows, tile_pages = q_ref.shape[0] // n_rows, pages_per_block // n_keys

    @pl.when((i == 0) & active)
    def _():
        copies.start(0, 0)
        # once: a q block's first update scales what the last one left by 0 (a finite sum)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((i + 1 < n) & ((step_flags_ref[nxt] & NOOP) == 0))
    def _():
        copies.start(nxt, nxt % 2)

    @pl.when(active)
    def _():
        slot = i % 2
        copies.wait(i, slot)

        @pl.when((flags & FIRST) != 0)
        def _():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

        tile_refs = (step_seq_ref, step_kv_ref, kv_lens_ref, shared_lens_ref, q_ref, pos_ref,
                     seq_ref, vis_ref, k_buf, v_buf, m_ref, l_ref, acc_ref)
        tile = functools.partial(_tile, refs=tile_refs, slot=slot, scale=scale,
                                 window=layer_ref[1] if windowed else None,
                                 tile_rows=tile_rows, tile_pages=tile_pages)
        for r in range(n_rows):
            for c in range(n_keys):
                if n_rows * n_keys == 1:
                    tile(r, c)
                else:  # a tile no row sees is skipped
                    pl.when((step_tiles_ref[i] >> (r * n_keys + c)) & 1 != 0)(
                        functools.partial(tile, r, c))

        @pl.when((flags & LAST) != 0)
        def _():
            _store_output(o_ref, l_ref, acc_ref, tile_rows=tile_rows)


def _block_pages(md: AttentionMetadata, ppb: int):
    """Each sequence's page table in whole KV blocks of `ppb` pages."""
    return jnp.pad(md.page_indices, ((0, 0), (0, -md.page_indices.shape[1] % ppb)))


def whole_blocks(md: AttentionMetadata, ppb: int, page_size: int, num_pages: int):
    """Per KV block of each sequence ([sequences x blocks a sequence], row-major), 1 where
    its pages that hold the sequence's keys follow each other in the pool and the block fits
    the pool from its first page (one copy each for K and V takes it), else 0: int32, from
    the page table alone (no gather), once a forward (the layer loop's invariant), not by
    each step's scalar unit."""
    pages = _block_pages(md, ppb)
    n_seqs, per_seq = pages.shape[0], pages.shape[1] // ppb
    blocks = pages.reshape(n_seqs, per_seq, ppb)
    j = jnp.arange(ppb)
    keys = md.kv_lens[:, None] - jnp.arange(per_seq) * ppb * page_size  # [seqs, blocks]
    first = blocks[..., :1]
    held = (j * page_size >= keys[..., None]) | (blocks == first + j)
    whole = jnp.all(held, axis=-1) & (first[..., 0] + ppb <= num_pages)
    return whole.astype(jnp.int32).reshape(-1)


def whole_block_steps(plan: AttentionPlan, md: AttentionMetadata, sizes: BlockSizes,
                      page_size: int, num_pages: int) -> int:
    """The real steps of a concrete `plan` whose KV block the kernel copies whole, for
    estimates."""
    ppb = sizes.kv_block // page_size
    real = (np.asarray(plan.step_flags) & NOOP) == 0
    whole = np.asarray(whole_blocks(md, ppb, page_size, num_pages))
    per_seq = whole.size // len(md.kv_lens)  # KV blocks a sequence
    steps = np.asarray(plan.step_seq) * per_seq + np.asarray(plan.step_kv)
    return int(np.sum(whole[steps[real]]))


def attention_cost(steps: int, q_blocks: int, rows: int, hkv: int, d: int, kv_block: int,
                   itemsize: int, live: float = 1.0) -> pl.CostEstimate:
    """Work of `steps` grid steps over `q_blocks` q blocks of `rows` rows (q_block x group) per
    KV head, `live` of the steps' tiles computed: skipped KV blocks and tiles cost nothing.
    In the kernel the plan is runtime data, so `steps` there is the size it is padded to, an
    upper bound; the grid runs only the real steps."""
    kv_bytes = 2 * steps * hkv * kv_block * d * itemsize
    q_out_bytes = 2 * q_blocks * hkv * rows * d * itemsize
    return pl.CostEstimate(flops=round(4 * live * steps * hkv * rows * kv_block * d),
                           transcendentals=round(live * steps * hkv * rows * kv_block),
                           bytes_accessed=kv_bytes + q_out_bytes)


def _in_blocks(q, md: AttentionMetadata, hkv: int, sizes: BlockSizes):
    """q [T, Hq, D] as [T padded to whole q blocks, Hq x D] (the projection's own layout),
    and each row's KV position, sequence and visible-from as [NB, tiles, rows]; a block's
    rows are (tile, query head in group, token), -1 for padding."""
    t, hq, d = q.shape
    bq, group, (n_tiles, _) = sizes.q_block, hq // hkv, sizes.tiles()
    n_blocks = num_q_blocks(t, sizes)
    pad = n_blocks * bq - t
    q_rows = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(t + pad, hq * d)

    def per_row(x, fill):
        x = jnp.pad(x, (0, pad), constant_values=fill).reshape(n_blocks, n_tiles, -1)
        return jnp.tile(x, (1, 1, group))

    plan = md.plan
    return (q_rows, per_row(plan.token_pos, -1), per_row(plan.token_seq, -1),
            per_row(md.visible_from, 0))


def _layer_and_window(layer, window):
    """SMEM [layer, window] (window 0: none)."""
    return jnp.stack([jnp.asarray(layer, jnp.int32),
                      jnp.asarray(0 if window is None else window, jnp.int32)])


def ragged_paged_attention(q, k_pages, v_pages, layer, md: AttentionMetadata, *,
                           sm_scale: float, max_q_len: int, sizes: BlockSizes, interpret=False,
                           softcap: float = 0.0, window=None):
    """Pallas kernel; `md.plan` comes from `plan_attention` (or `build_plan`) on the same
    metadata and block sizes. `softcap` and `window` (the layer's, traced; 0: none) as the
    reference's; the plan's blocks and tiles are a superset of what a window leaves."""
    del max_q_len  # the plan bounds the work
    check_attention_shapes(q, k_pages, v_pages, md)
    plan = md.plan
    if not isinstance(plan, AttentionPlan):
        raise ValueError("the Pallas kernel needs metadata.plan, from "
                         "attention_plan.plan_attention")
    if plan.items is not None or sizes.item_q_block:
        raise ValueError(f"the Pallas kernel has no item steps; block sizes {sizes}")
    n_layers, hkv, _, page_size, d = k_pages.shape
    sizes.check(page_size)
    t, hq, _ = q.shape
    group, bq = hq // hkv, sizes.q_block
    if plan.token_pos.shape != (t,):
        raise ValueError(f"a plan for {plan.token_pos.shape[0]} tokens, q has {t}")
    if (plan.step_tiles is None) != (sizes.tile == 0):
        raise ValueError(f"a plan {'without' if plan.step_tiles is None else 'with'} tiles "
                         f"for block sizes {sizes}")
    n_blocks, tiles = num_q_blocks(t, sizes), sizes.tiles()
    rows = group * bq // tiles[0]  # of a tile
    step_tiles = plan.step_flags if plan.step_tiles is None else plan.step_tiles  # unread
    ppb = sizes.kv_block // page_size
    pages = _block_pages(md, ppb)
    block_map = lambda i, lyr, sb, *_: (sb[i], 0)  # noqa: E731
    row_map = lambda i, lyr, sb, *_: (sb[i], 0, 0)  # noqa: E731
    kernel = functools.partial(_kernel, scale=_Scale(sm_scale, softcap),
                               windowed=window is not None, pages_per_seq=pages.shape[1],
                               pages_per_block=ppb, tiles=tiles)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=10,
        grid=(jnp.asarray(plan.num_steps, jnp.int32),),
        in_specs=[pl.BlockSpec((bq, hq * d), block_map)]
        + [pl.BlockSpec((1, tiles[0], rows), row_map)] * 3
        + [pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=pl.BlockSpec((bq, hq * d), block_map),
        scratch_shapes=[pltpu.VMEM((2, hkv, ppb, page_size, d), k_pages.dtype),
                        pltpu.VMEM((2, hkv, ppb, page_size, d), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((hkv, tiles[0], 1, rows), jnp.float32),
                        pltpu.VMEM((hkv, tiles[0], 1, rows), jnp.float32),
                        pltpu.VMEM((hkv, tiles[0], d, rows), jnp.float32)])
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec, name="ragged_paged_attention",
        out_shape=jax.ShapeDtypeStruct((n_blocks * bq, hq * d), q.dtype),
        # the output takes q's buffer: a q block is read before its output is written, and
        # blocks of padding only, which have no step, keep q's (finite) rows, with no
        # buffer of zeros to write in every layer (32 MiB at 8192 tokens: docs/tpu_v6e.md)
        input_output_aliases={10: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=attention_cost(plan.step_block.shape[0], n_blocks, group * bq, hkv, d,
                                     sizes.kv_block, k_pages.dtype.itemsize),
        interpret=interpret,
    )(_layer_and_window(layer, window), plan.step_block, plan.step_seq,
      plan.step_kv, plan.step_flags, step_tiles, pages.reshape(-1),
      whole_blocks(md, ppb, page_size, k_pages.shape[2]), md.kv_lens, md.shared_lens,
      *_in_blocks(q, md, hkv, sizes), k_pages, v_pages)
    return out[:t].reshape(t, hq, d)
