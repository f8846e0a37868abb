"""Ragged paged attention with the multi-item mask: the planned path for XLA (CPU, GPU).

Same semantics as `ragged_paged_attention_reference` and the same AttentionPlan as the
Pallas kernel, plus its item steps where the block sizes name them: two loops over the plan's
real steps (dynamic trip counts), one (q block, KV window) pair per step with a float32
online softmax. Work grows with the visible KV blocks, not with the padded shapes, so one
compiled program serves every batch of a shape bucket at the cost of the batch it is given.

The softmax state of every row (running max, sum and unnormalised output) lives in arrays over
all tokens: a step reads its q block's slice, folds in its window and writes the slice back,
so the block steps and then the item steps may visit a row in any order; the output is divided
once at the end. A step masks with the multi-item mask and its side of the sequence's
`kv_split` (block steps below it, item steps from it), so no position is counted twice.
The mask is an additive bias; a row that sees nothing yet (of another sequence than the
step's, or a padding row) takes in junk with a running max of -1e30, and the first key it
does see rescales that junk by exp(-1e30 - max) = 0.
"""
import functools
import math

import jax
import jax.numpy as jnp

from kernels.attention_plan import AttentionPlan, BlockSizes
from kernels.ragged_paged_attention import (
    MASKED,
    AttentionMetadata,
    check_attention_shapes,
    gather_pages,
    soft_capped,
    visible_mask,
)


def _window_kv(pages_of_seq, start, width, k_pages, v_pages, layer):
    """K/V of KV positions [start, start + width) of one sequence (start page-aligned):
    [Hkv, width, D] each."""
    page = k_pages.shape[3]
    pages = jax.lax.dynamic_slice(pages_of_seq, (start // page,), (width // page,))
    return gather_pages(k_pages, layer, pages), gather_pages(v_pages, layer, pages)


def _row_reduce(op, x, fold: int = 16):
    """op over the last axis. XLA's CPU backend reduces a minor axis at a third of the speed of
    an elementwise pass, so the columns are first folded `fold` wide by elementwise ops: a
    step's max and sum then take 0.6 of the time (docs/performance_cpu.md, "Forward per bucket")."""
    if x.shape[-1] % fold:
        return op.reduce(x, axis=-1)
    parts = [x[..., i:i + fold] for i in range(0, x.shape[-1], fold)]
    return op.reduce(functools.reduce(op, parts), axis=-1)


def _step(i, state, *, block, seq, start, q_block, width, below_split, q, k_pages, v_pages,
          layer, pages, md, rows, split, sm_scale, softcap, window):
    """Step i: q block block[i] of `q_block` rows, sequence seq[i], KV positions [start[i],
    start[i] + width). q is [Hkv, group, tokens, D]; a block's rows are (query head in group,
    token), as in the kernel. `rows`: each token's (KV position, sequence, visible-from)."""
    m_all, total_all, acc_all = state
    hkv, group, _, d = q.shape
    s_i, first_col, row0 = seq[i], start[i], block[i] * q_block
    pos, row_seq, vis = (jax.lax.dynamic_slice(x, (row0,), (q_block,)) for x in rows)
    pos = jnp.where(row_seq == s_i, pos, -1)
    cols = first_col + jnp.arange(width)
    side = cols < split[s_i] if below_split else cols >= split[s_i]
    mask = visible_mask(pos, vis, md.shared_lens[s_i], md.kv_lens[s_i], cols, window)
    bias = jnp.where(mask & side[None], 0.0, MASKED)
    k, v = _window_kv(pages[s_i], first_col, width, k_pages, v_pages, layer)
    rows_of = lambda x: jax.lax.dynamic_slice_in_dim(x, row0, q_block, axis=2)  # noqa: E731
    q_rows = rows_of(q).reshape(hkv, group * q_block, d)
    # The scale on the window's keys: a pass over [Hkv, width, D] instead of over the scores.
    s = soft_capped(jnp.einsum("hrd,hkd->hrk", q_rows, k.astype(jnp.float32) * sm_scale),
                    softcap)
    s = (s.reshape(hkv, group, q_block, width) + bias).reshape(hkv, -1, width)
    m, total = (rows_of(x).reshape(hkv, -1) for x in (m_all, total_all))
    m_new = jnp.maximum(m, _row_reduce(jnp.maximum, s))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    total = alpha * total + _row_reduce(jnp.add, p)
    acc = (alpha[..., None] * rows_of(acc_all).reshape(hkv, -1, d)
           + jnp.einsum("hrk,hkd->hrd", p, v.astype(jnp.float32)))
    put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        x, new.reshape(hkv, group, q_block, *x.shape[3:]), row0, axis=2)
    return put(m_all, m_new), put(total_all, total), put(acc_all, acc)


def block_rows(t: int, sizes: BlockSizes) -> int:
    """The block steps' q block for `t` tokens. Fewer tokens than sizes.q_block make one
    block, whose rows need only cover them (whole item blocks): a 16-token program on CPU
    then scores 48 rows against a KV block, not 384."""
    unit = sizes.item_q_block or 1
    return min(sizes.q_block, -(-t // unit) * unit)


def _check_plan(plan, t: int, sizes: BlockSizes) -> None:
    if not isinstance(plan, AttentionPlan):
        raise ValueError("the planned attention needs metadata.plan, from plan_attention")
    if plan.token_pos.shape != (t,):
        raise ValueError(f"a plan for {plan.token_pos.shape[0]} tokens, q has {t}")
    if (plan.items is not None) != (sizes.item_q_block > 0):
        raise ValueError(f"a plan {'with' if plan.items is not None else 'without'} item "
                         f"steps for block sizes {sizes}")


def ragged_paged_attention_xla(q, k_pages, v_pages, layer, md: AttentionMetadata, *,
                               sm_scale: float, max_q_len: int, sizes: BlockSizes,
                               softcap: float = 0.0, window=None):
    """`md.plan` comes from `plan_attention` (or `build_plan`) on the same metadata and block
    sizes. `softcap` and `window`: as the reference's (the plan's blocks are a superset of
    what a window leaves)."""
    del max_q_len  # the plan bounds the work
    check_attention_shapes(q, k_pages, v_pages, md)
    page_size = k_pages.shape[3]
    sizes.check(page_size)
    t, hq, d = q.shape
    plan = md.plan
    _check_plan(plan, t, sizes)
    hkv, widest = k_pages.shape[1], max(sizes.kv_block, sizes.item_kv_block)
    q_block = block_rows(t, sizes)
    group, pad = hq // hkv, -t % math.lcm(q_block, sizes.item_q_block or 1)
    pages = jnp.pad(md.page_indices, ((0, 0), (0, widest // page_size)))
    # Heads first, then split (a bitcast): XLA writes [Hkv, group, T, D] in one pass, where
    # splitting first took a second copy.
    q_heads = q.astype(jnp.float32).transpose(1, 0, 2).reshape(hkv, group, t, d)
    q_heads = jnp.pad(q_heads, ((0, 0), (0, 0), (0, pad), (0, 0)))
    rows = tuple(jnp.pad(x, (0, pad), constant_values=fill) for x, fill in (
        (plan.token_pos, -1), (plan.token_seq, -1), (md.visible_from, 0)))
    split = md.kv_lens if plan.kv_split is None else plan.kv_split
    step = functools.partial(
        _step, q=q_heads, k_pages=k_pages, v_pages=v_pages, layer=layer, pages=pages, md=md,
        rows=rows, split=split, sm_scale=sm_scale, softcap=softcap, window=window)
    stats = jnp.full(q_heads.shape[:3], MASKED, jnp.float32)
    state = (stats, jnp.zeros_like(stats), jnp.zeros_like(q_heads))
    blocks = functools.partial(step, block=plan.step_block, seq=plan.step_seq,
                               start=plan.step_kv * sizes.kv_block, q_block=q_block,
                               width=sizes.kv_block, below_split=True)
    state = jax.lax.fori_loop(0, jnp.asarray(plan.num_steps, jnp.int32), blocks, state)
    if plan.items is not None:
        items = plan.items
        windows = functools.partial(step, block=items.block, seq=items.seq, start=items.start,
                                    q_block=sizes.item_q_block, width=sizes.item_kv_block,
                                    below_split=False)
        state = jax.lax.fori_loop(0, jnp.asarray(items.num_steps, jnp.int32), windows, state)
    _, total, acc = state
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # rows no step visited: 0
    return out[:, :, :t].transpose(2, 0, 1, 3).reshape(t, hq, d).astype(q.dtype)
