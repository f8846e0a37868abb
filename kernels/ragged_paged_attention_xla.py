"""Ragged paged attention with the multi-item mask: the planned path for XLA (CPU, GPU).

Same semantics as `ragged_paged_attention_reference` and the same AttentionPlan as the
Pallas kernel: a loop over the plan's real steps (a dynamic trip count), one (q block,
visible KV block) pair per step with a float32 online softmax. Work grows with the visible
KV blocks, not with the padded shapes, so one compiled program serves every batch of a
shape bucket at the cost of the batch it is given.

What runs per step is kept to the two matmuls and one pass over the scores. The plan's q
blocks are runs of packed tokens in order, so a step reads its rows as a slice of q and
writes them as a slice of the output; a block's steps are consecutive, its last one storing
the final result of all its rows. The mask is an additive bias; a row that sees nothing yet
(of another sequence than the step's, or a padding row) takes in junk with a running max of
-1e30, and the first key it does see rescales that junk by exp(-1e30 - max) = 0.
"""
import functools

import jax
import jax.numpy as jnp

from kernels.attention_plan import FIRST, AttentionPlan, BlockSizes, num_q_blocks
from kernels.ragged_paged_attention import (
    MASKED,
    AttentionMetadata,
    check_attention_shapes,
    gather_pages,
    visible_mask,
)


def _block_kv(pages_of_seq, kv, k_pages, v_pages, layer, pages_per_block):
    """K/V of KV block `kv` of one sequence: [Hkv, kv_block, D] each."""
    pages = jax.lax.dynamic_slice(pages_of_seq, (kv * pages_per_block,), (pages_per_block,))
    return gather_pages(k_pages, layer, pages), gather_pages(v_pages, layer, pages)


def _step(i, carry, *, q, k_pages, v_pages, layer, pages, md, rows, plan, sm_scale, sizes):
    """One (q block, sequence, KV block) step. q and the output are [Hkv, group, blocks x
    q_block, D]; a block's rows are (query head in group, token), as in the kernel. `rows`:
    each token's (KV position, sequence, visible-from), padded to the blocks."""
    out, m, total, acc = carry
    seq, kv, first = plan.step_seq[i], plan.step_kv[i], (plan.step_flags[i] & FIRST) != 0
    reset = ((m, MASKED), (total, 0.0), (acc, 0.0))
    m, total, acc = (jnp.where(first, init, x) for x, init in reset)
    hkv, group, _, d = q.shape
    bq, kb = sizes.q_block, sizes.kv_block
    start = plan.step_block[i] * bq
    pos, row_seq, vis = (jax.lax.dynamic_slice(x, (start,), (bq,)) for x in rows)
    pos = jnp.where(row_seq == seq, pos, -1)
    q_block = jax.lax.dynamic_slice(q, (0, 0, start, 0), (hkv, group, bq, d))
    k, v = _block_kv(pages[seq], kv, k_pages, v_pages, layer, kb // k_pages.shape[3])
    s = jnp.einsum("hrd,hkd->hrk", q_block.reshape(hkv, group * bq, d), k.astype(jnp.float32))
    cols = kv * kb + jnp.arange(kb)
    mask = visible_mask(pos, vis, md.shared_lens[seq], md.kv_lens[seq], cols)
    bias = jnp.where(mask, 0.0, MASKED)
    s = (s.reshape(hkv, group, bq, kb) * sm_scale + bias).reshape(hkv, group * bq, kb)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    total = alpha * total + p.sum(axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum("hrk,hkd->hrd", p, v.astype(jnp.float32))
    done = (acc / total[..., None]).reshape(hkv, group, bq, d)
    out = jax.lax.dynamic_update_slice(out, done, (0, 0, start, 0))
    return out, m_new, total, acc


def ragged_paged_attention_xla(q, k_pages, v_pages, layer, md: AttentionMetadata, *,
                               sm_scale: float, max_q_len: int, sizes: BlockSizes):
    """`md.plan` comes from `build_plan` on the same metadata and block sizes."""
    del max_q_len  # the plan bounds the work
    check_attention_shapes(q, k_pages, v_pages, md)
    plan = md.plan
    if not isinstance(plan, AttentionPlan):
        raise ValueError("the planned attention needs metadata.plan, from build_plan")
    page_size = k_pages.shape[3]
    sizes.check(page_size)
    t, hq, d = q.shape
    if plan.token_pos.shape != (t,):
        raise ValueError(f"a plan for {plan.token_pos.shape[0]} tokens, q has {t}")
    hkv, bq = k_pages.shape[1], sizes.q_block
    group, pad = hq // hkv, num_q_blocks(t, sizes) * bq - t
    pages = md.page_indices
    pages = jnp.pad(pages, ((0, 0), (0, -pages.shape[1] % (sizes.kv_block // page_size))))
    q_heads = q.astype(jnp.float32).reshape(t, hkv, group, d).transpose(1, 2, 0, 3)
    q_heads = jnp.pad(q_heads, ((0, 0), (0, 0), (0, pad), (0, 0)))
    rows = tuple(jnp.pad(x, (0, pad), constant_values=fill) for x, fill in (
        (plan.token_pos, -1), (plan.token_seq, -1), (md.visible_from, 0)))
    step = functools.partial(
        _step, q=q_heads, k_pages=k_pages, v_pages=v_pages, layer=layer, pages=pages,
        md=md, rows=rows, plan=plan, sm_scale=sm_scale, sizes=sizes)
    stats = jnp.full((hkv, group * bq), MASKED, jnp.float32)
    carry = (jnp.zeros_like(q_heads), stats, jnp.zeros_like(stats),
             jnp.zeros((hkv, group * bq, d), jnp.float32))
    out = jax.lax.fori_loop(0, jnp.asarray(plan.num_steps, jnp.int32), step, carry)[0]
    return out[:, :, :t].transpose(2, 0, 1, 3).reshape(t, hq, d).astype(q.dtype)
