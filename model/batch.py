"""What one forward pass computes: packed ragged tokens and the rows to score."""
from typing import NamedTuple

import jax

from kernels.ragged_paged_attention import AttentionMetadata


class ForwardBatch(NamedTuple):
    tokens: jax.Array        # [T] int32, packed new tokens of every sequence
    positions: jax.Array     # [T] int32, RoPE positions
    kv_pages: jax.Array      # [W] int32, pages the new K/V fill; out of the pool = padding
    kv_page_tokens: jax.Array  # [W, page_size] int32, the token of each row of those pages
    attention: AttentionMetadata
    score_rows: jax.Array    # [R] int32, indices into tokens of the rows to score
    label_ids: jax.Array     # [R, K] int32, head rows to read per scored row
    num_rows: jax.Array      # [] int32, the real rows (the rest are padding)
    num_labels: jax.Array    # [] int32, the most real label ids of a row (the rest are padding)
    with_logsumexp: jax.Array  # [] bool, also the full-vocabulary logsumexp of each row


class KVCache(NamedTuple):
    k: jax.Array  # [layers, Hkv, num_pages, page_size, D]
    v: jax.Array
