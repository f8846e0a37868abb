"""Random ragged batches for the attention kernel: causal, prefix-cached and multi-item."""
import jax.numpy as jnp
import numpy as np

from kernels.ragged_paged_attention import AttentionMetadata


def random_batch(rng, specs, *, hq, hkv, d, page_size, dtype, layers=2, num_pages=None,
                 pad_tokens=5, consecutive_pages=False):
    """specs: ("causal", n) | ("cached", cached, n) | ("items", L, [item lens]) |
    ("cached_items", L, [item lens]): the items of a query the prefix cache holds. Each
    sequence's pages are a random draw of the pool, or follow each other from page 1.

    Returns q, k_pages, v_pages, metadata (as NumPy-friendly jnp arrays)."""
    q_lens, kv_lens, prefixes, vis = [], [], [], []
    for spec in specs:
        if spec[0] in ("items", "cached_items"):
            kind, prefix, items = spec
            starts = prefix + np.concatenate([[0], np.cumsum(items)[:-1]]).astype(int)
            v = [int(s) for s, n in zip(starts, items) for _ in range(n)]
            v = v if kind == "cached_items" else [0] * prefix + v
            q_lens.append(len(v)), kv_lens.append(prefix + sum(items)), prefixes.append(prefix)
        else:
            cached, n = (0, spec[1]) if spec[0] == "causal" else spec[1:]
            v = [0] * n
            q_lens.append(n), kv_lens.append(cached + n), prefixes.append(0)
        vis += v
    pages_per_seq = max(-(-k // page_size) for k in kv_lens)
    num_pages = num_pages or len(specs) * pages_per_seq + 3
    order = np.arange(1, num_pages) if consecutive_pages else rng.permutation(num_pages)
    tables = order[:len(specs) * pages_per_seq].reshape(len(specs), -1)
    n_tokens = sum(q_lens) + pad_tokens
    shape = (layers, hkv, num_pages, page_size, d)
    md = AttentionMetadata(
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32), page_indices=jnp.asarray(tables, jnp.int32),
        shared_lens=jnp.asarray(prefixes, jnp.int32),
        visible_from=jnp.asarray(vis + [0] * pad_tokens, jnp.int32))
    q = jnp.asarray(rng.standard_normal((n_tokens, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    return q, k, v, md, sum(q_lens)
