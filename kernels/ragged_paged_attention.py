"""Ragged paged attention with the multi-item-scoring mask: the plain-JAX reference.

Layout (shared with the Pallas kernel):
  q          [T, Hq, D]   packed new tokens of all sequences
  k/v_pages  [layers, Hkv, num_pages, page_size, D]   the whole cache; `layer` picks one
  metadata   AttentionMetadata, see below

Token t of sequence s sits at KV position p(t) = kv_lens[s] - q_len[s] + (t - cu_q_lens[s]);
it sees KV position j iff  j <= p(t)  and  (j < shared_lens[s]  or  j >= visible_from[t]).
Causal sequences have shared_lens = visible_from = 0.

A sliding window W (a layer's, traced) applies by *logical* position, the one a token has when
its item is scored alone (query, then its own item): an item token's logical distance to a
query key j < L is p(t) - j - (a(t) - L), to a key of its own item p(t) - j; it sees the key
iff that distance < W (HF's `q - k < W`). The window never lets a token see more.
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kernels.attention_plan import expand_ranges

MASKED = -1e30  # a masked score: exp(MASKED - any real score) is 0


class AttentionMetadata(NamedTuple):
    cu_q_lens: jax.Array     # [S + 1] int32, offsets of each sequence in the packed tokens
    kv_lens: jax.Array       # [S] int32, KV length (cached prefix + new tokens)
    page_indices: jax.Array  # [S, pages_per_seq] int32, page table
    shared_lens: jax.Array   # [S] int32, L: positions every token sees (0: plain causal)
    visible_from: jax.Array  # [T] int32, a(t): first KV position past L that token t sees
    plan: Any = None         # AttentionPlan for the planned kernels (plan_attention); unused here
    window_plan: Any = None  # and the plan of a model's windowed layers (plan_attention)


def check_attention_shapes(q, k_pages, v_pages, md: AttentionMetadata) -> None:
    if q.ndim != 3 or k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"expected q [T, Hq, D] and k/v pages [layers, Hkv, pages, "
                         f"page_size, D], got q {q.shape}, k {k_pages.shape}, v {v_pages.shape}")
    t, hq, d = q.shape
    hkv = k_pages.shape[1]
    if k_pages.shape[-1] != d or hq % hkv:
        raise ValueError(f"q {q.shape} does not fit k/v pages {k_pages.shape} (head_dim, GQA)")
    s = md.kv_lens.shape[0]
    if (md.cu_q_lens.shape != (s + 1,) or md.shared_lens.shape != (s,)
            or md.page_indices.ndim != 2 or md.page_indices.shape[0] != s
            or md.visible_from.shape != (t,)):
        raise ValueError(f"metadata shapes do not fit {s} sequences and {t} tokens: "
                         f"{jax.tree.map(jnp.shape, md)}")


def written_pages(md: AttentionMetadata, page_size: int, num_pages: int):
    """The pages the new tokens fill [W] (`num_pages`, out of the pool, for padding) and the
    packed token of each of their rows [W, page_size] (rows past a sequence's end repeat its
    last token), W the most that any batch of `md`'s shapes fills: every page of its tokens,
    and a part page more a sequence. A sequence's new tokens start on a page boundary (the
    prefix cache holds whole pages), so the pages follow its cached ones in its page table."""
    n_seqs, pages_per_seq = md.page_indices.shape
    size = -(-md.visible_from.shape[0] // page_size) + n_seqs
    new = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    first = (md.kv_lens - new) // page_size
    seq, column, total = expand_ranges(first, -(-new // page_size), size)
    real = jnp.arange(size) < total
    page_ids = md.page_indices[seq, jnp.clip(column, 0, pages_per_seq - 1)]
    rows = (column - first[seq])[:, None] * page_size + jnp.arange(page_size)
    tokens = md.cu_q_lens[seq][:, None] + jnp.minimum(rows, new[seq][:, None] - 1)
    return (jnp.where(real, page_ids, num_pages).astype(jnp.int32),
            jnp.where(real[:, None], tokens, 0).astype(jnp.int32))


def page_blocks(x, page_tokens):
    """New tokens' K or V [T, Hkv, D] as whole pages [W, Hkv, page_size, D]: row r of block w
    is token page_tokens[w, r]. A sequence's new tokens start on a page boundary (the prefix
    cache holds full pages only), so each page it writes is its own, wholly."""
    return x[page_tokens].transpose(0, 2, 1, 3)


def write_kv_pages(k_pages, v_pages, layer, k_blocks, v_blocks, page_ids):
    """Writes whole pages: k/v_blocks [W, Hkv, page_size, D] into pages page_ids [W] of
    `layer`. A page id outside the pool (padding) is dropped.

    Rows of a sequence's last page past its end hold whatever `page_blocks` put there; they
    lie past kv_len, where attention never looks.
    """
    def put(pages, blocks):
        return pages.at[layer, :, page_ids].set(blocks.astype(pages.dtype), mode="drop")

    return put(k_pages, k_blocks), put(v_pages, v_blocks)


def gather_pages(pages, layer, ids):
    """[Hkv, len(ids) * page_size, D]: pages `ids` of `layer`, gathered from the pool directly
    (slicing the layer out first would copy it on every call)."""
    hkv, d = pages.shape[1], pages.shape[-1]
    return pages[layer, :, ids].transpose(1, 0, 2, 3).reshape(hkv, -1, d)


def sees(kv_pos, q_pos, visible_from, shared_len, kv_len, window=None):
    """The multi-item mask, elementwise (broadcasting): a token at KV position `q_pos` sees
    position `kv_pos` iff it is not later, and is shared or in the token's own window, and
    holds a key, and (a sliding `window` > 0) lies within the window by logical position.
    Every kernel masks with this; the attention plan's `_kv_block_steps` is its block-level
    form."""
    in_window = (kv_pos < shared_len) | (kv_pos >= visible_from)
    visible = (kv_pos <= q_pos) & in_window & (kv_pos < kv_len)
    if window is None:
        return visible
    return visible & ((window <= 0) | (logical_distance(kv_pos, q_pos, visible_from,
                                                        shared_len) < window))


def logical_distance(kv_pos, q_pos, visible_from, shared_len):
    """How far back a visible key lies from the token by logical position: an item token
    (visible_from past the shared query) is as far from the query as if its item followed
    the query directly."""
    gap = jnp.maximum(visible_from - shared_len, 0)
    return q_pos - kv_pos - jnp.where(kv_pos < shared_len, gap, 0)


def soft_capped(s, softcap: float):
    """cap * tanh(s / cap): Gemma 2's attention scores (before the mask) and final logits."""
    return s if not softcap else softcap * jnp.tanh(s / softcap)


def visible_mask(q_pos, visible_from, shared_len, kv_len, kv_pos, window=None):
    """[Q, K] bool: `sees` for every (token, key) pair."""
    return sees(kv_pos[None, :], q_pos[:, None], visible_from[:, None], shared_len, kv_len,
                window)


def _seq_block_attention(q_blk, k_seq, v_seq, q_pos, vis, shared_len, kv_len, sm_scale,
                         softcap, window):
    """q_blk [C, Hq, D]; k/v_seq [Hkv, K, D] -> [C, Hq, D] (float32 math)."""
    c, hq, d = q_blk.shape
    hkv, kv_max, _ = k_seq.shape
    qg = q_blk.astype(jnp.float32).reshape(c, hkv, hq // hkv, d)
    s = jnp.einsum("chgd,hkd->hgck", qg, k_seq.astype(jnp.float32)) * sm_scale
    s = soft_capped(s, softcap)
    mask = visible_mask(q_pos, vis, shared_len, kv_len, jnp.arange(kv_max), window)
    s = jnp.where(mask[None, None], s, MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("hgck,hkd->chgd", p, v_seq.astype(jnp.float32))
    return out.reshape(c, hq, d)


def ragged_paged_attention_reference(q, k_pages, v_pages, layer, md: AttentionMetadata, *,
                                     sm_scale: float, max_q_len: int, q_block: int = 256,
                                     softcap: float = 0.0, window=None):
    """Reference path. Every sequence must have at most `max_q_len` new tokens. `softcap`:
    the scores', before the mask; `window`: the layer's sliding window (0: none)."""
    q, k_pages, v_pages, md = jax.tree.map(jnp.asarray, (q, k_pages, v_pages, md))
    check_attention_shapes(q, k_pages, v_pages, md)
    t, hq, d = q.shape
    n_seqs, pages_per_seq = md.page_indices.shape
    q_block = min(q_block, max_q_len)
    n_blocks = -(-max_q_len // q_block)
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]

    def one_block(idx):
        s, b = idx // n_blocks, idx % n_blocks
        i = b * q_block + jnp.arange(q_block)
        tok = jnp.clip(md.cu_q_lens[s] + i, 0, t - 1)
        q_pos = md.kv_lens[s] - q_lens[s] + i
        k_seq = gather_pages(k_pages, layer, md.page_indices[s])
        v_seq = gather_pages(v_pages, layer, md.page_indices[s])
        return _seq_block_attention(q[tok], k_seq, v_seq, q_pos, md.visible_from[tok],
                                    md.shared_lens[s], md.kv_lens[s], sm_scale, softcap,
                                    window)

    blocks = jax.lax.map(one_block, jnp.arange(n_seqs * n_blocks))
    per_seq = blocks.reshape(n_seqs, n_blocks * q_block, hq, d)
    tokens = jnp.arange(t)
    seq_of = jnp.clip(jnp.searchsorted(md.cu_q_lens[1:], tokens, side="right"), 0, n_seqs - 1)
    row = jnp.clip(tokens - md.cu_q_lens[seq_of], 0, n_blocks * q_block - 1)
    return per_seq[seq_of, row].astype(q.dtype)
