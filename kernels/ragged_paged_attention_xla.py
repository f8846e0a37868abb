"""Ragged paged attention with the multi-item mask: the planned path for XLA (CPU, GPU).

Same semantics as `ragged_paged_attention_reference` and the same AttentionPlan as the
Pallas kernel: a loop over the plan's real steps (a dynamic trip count), one (q block,
visible KV block) pair per step with a float32 online softmax. Work grows with the visible
KV blocks, not with the padded shapes, so one compiled program serves every batch of a
shape bucket at the cost of the batch it is given.
"""
import functools

import jax
import jax.numpy as jnp

from kernels.attention_plan import FIRST, AttentionPlan, BlockSizes
from kernels.ragged_paged_attention import (
    AttentionMetadata,
    check_shapes,
    gather_pages,
    visible_mask,
)

_MASKED = -1e30


def _block_kv(pages_of_seq, kv, k_pages, v_pages, layer, pages_per_block):
    """K/V of KV block `kv` of one sequence: [Hkv, kv_block, D] each."""
    pages = jax.lax.dynamic_slice(pages_of_seq, (kv * pages_per_block,), (pages_per_block,))
    return gather_pages(k_pages, layer, pages), gather_pages(v_pages, layer, pages)


def _step(i, carry, *, q_blocks, k_pages, v_pages, layer, pages, md, plan, sm_scale, sizes):
    """One (q block, KV block) pair; rows are (query head in group, token), as in the kernel."""
    out, m, total, acc = carry
    block, kv, first = plan.step_block[i], plan.step_kv[i], (plan.step_flags[i] & FIRST) != 0
    reset = ((m, _MASKED), (total, 0.0), (acc, 0.0))
    m, total, acc = (jnp.where(first, init, x) for x, init in reset)
    seq, pos = plan.block_seq[block], plan.row_pos[block]
    k, v = _block_kv(pages[seq], kv, k_pages, v_pages, layer, sizes.kv_block // k_pages.shape[3])
    s = jnp.einsum("hrd,hkd->hrk", q_blocks[block], k.astype(jnp.float32)) * sm_scale
    cols = kv * sizes.kv_block + jnp.arange(sizes.kv_block)
    mask = visible_mask(pos, plan.row_vis[block], md.prefix_lens[seq], md.kv_lens[seq], cols)
    mask = jnp.tile(mask & (pos >= 0)[:, None], (s.shape[1] // pos.shape[0], 1))
    s = jnp.where(mask, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    total = alpha * total + p.sum(axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum("hrk,hkd->hrd", p, v.astype(jnp.float32))
    # Every step stores its q block's running result; a block's last step leaves the final one.
    done = acc / jnp.where(total > 0, total, 1.0)[..., None]
    out = jax.lax.dynamic_update_slice(out, done[None], (block, 0, 0, 0))
    return out, m_new, total, acc


def ragged_paged_attention_xla(q, k_pages, v_pages, layer, md: AttentionMetadata, *,
                               sm_scale: float, max_q_len: int, sizes: BlockSizes):
    """`md.plan` comes from `build_plan` on the same metadata and block sizes."""
    del max_q_len  # the plan bounds the work
    check_shapes(q, k_pages, v_pages, md)
    plan = md.plan
    if not isinstance(plan, AttentionPlan):
        raise ValueError("the planned attention needs metadata.plan, from build_plan")
    page_size = k_pages.shape[3]
    sizes.check(page_size)
    if plan.block_tokens.shape[1] != sizes.q_block:
        raise ValueError(f"plan q blocks of {plan.block_tokens.shape[1]} rows, "
                         f"sizes say {sizes.q_block}")
    t, hq, d = q.shape
    hkv, bq = k_pages.shape[1], sizes.q_block
    group, n_blocks = hq // hkv, plan.block_tokens.shape[0]
    per_block = sizes.kv_block // page_size
    pages = md.page_indices
    pages = jnp.pad(pages, ((0, 0), (0, -pages.shape[1] % per_block)))
    q_blocks = q[plan.block_tokens].astype(jnp.float32).reshape(n_blocks, bq, hkv, group, d)
    q_blocks = q_blocks.transpose(0, 2, 3, 1, 4).reshape(n_blocks, hkv, group * bq, d)
    step = functools.partial(
        _step, q_blocks=q_blocks, k_pages=k_pages, v_pages=v_pages, layer=layer, pages=pages,
        md=md, plan=plan, sm_scale=sm_scale, sizes=sizes)
    stats = jnp.full((hkv, group * bq), _MASKED, jnp.float32)
    carry = (jnp.zeros((n_blocks, hkv, group * bq, d), jnp.float32), stats,
             jnp.zeros_like(stats), jnp.zeros((hkv, group * bq, d), jnp.float32))
    out = jax.lax.fori_loop(0, jnp.asarray(plan.num_steps, jnp.int32), step, carry)[0]
    out = out.reshape(n_blocks, hkv, group, bq, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(n_blocks, bq, hq, d)[plan.token_block, plan.token_row].astype(q.dtype)
