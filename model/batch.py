"""What one forward pass computes: packed ragged tokens and the rows to score."""
from typing import NamedTuple

import jax
import numpy as np

from kernels.ragged_paged_attention import AttentionMetadata


class ForwardBatch(NamedTuple):
    tokens: jax.Array        # [T] int32, packed new tokens of every sequence
    positions: jax.Array     # [T] int32, RoPE positions
    attention: AttentionMetadata
    score_rows: jax.Array    # [R] int32, indices into tokens of the rows to score
    label_ids: jax.Array     # [R, K] int32, head rows to read per scored row
    num_rows: jax.Array      # [] int32, the real rows (the rest are padding)
    num_labels: jax.Array    # [] int32, the most real label ids of a row (the rest are padding)
    with_logsumexp: jax.Array  # [] bool, also the full-vocabulary logsumexp of each row
    block_pages: jax.Array | None = None  # [T // page_size] int32: where each sequence's new
    #   tokens start on a block of page_size tokens (page-aligned, runtime.batch_builder), the
    #   page each block fills, -1 for padding; None where they are packed without gaps


def pack(batch: ForwardBatch) -> np.ndarray:
    """The batch's arrays (all int32 or bool) as one int32 vector, in tree order: a forward's
    inputs go to the devices in one copy, not one an array (some 15 us each on CPU)."""
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(batch)], dtype=np.int32)


def unpack(packed: jax.Array, like: ForwardBatch) -> ForwardBatch:
    """`pack`'s inverse inside a program: `like` gives the arrays' shapes and dtypes."""
    leaves, tree = jax.tree.flatten(like)
    sizes = [int(np.size(x)) for x in leaves]
    if packed.shape != (sum(sizes),):
        raise ValueError(f"a packed batch of shape {packed.shape}, expected ({sum(sizes)},)")
    ends = np.cumsum(sizes)
    return jax.tree.unflatten(tree, [
        packed[end - size:end].reshape(np.shape(x)).astype(np.asarray(x).dtype)
        for x, size, end in zip(leaves, sizes, ends)])


class KVCache(NamedTuple):
    k: jax.Array  # [layers, Hkv, pages, page_size, D] (model.decoder.kv_pool_shape)
    v: jax.Array
