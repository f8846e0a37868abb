"""Final RMSNorm + label-logit gather (+ full-vocabulary logsumexp): the plain-JAX reference.

  hidden     [R, H]   the scored rows only
  head       [V, H]   LM head, tied embedding, or a classifier's score head (V = classes)
  label_ids  [R, K]   int32, runtime data (padded to a bucket), never static
returns label logits [R, K] float32 and, with `with_logsumexp`, logsumexp [R] float32.
"""
import functools

import jax
import jax.numpy as jnp

from kernels.ragged_paged_attention import soft_capped
from kernels.rms_norm import rms_norm

# With the logsumexp every row block reads the whole head, as vocabulary-major logits
# [V, rows] (head . x^T): on CPU (XLA's Eigen dots, runtime.forward_programs) x . head^T took
# 4x as long at 2-6 rows (docs/performance_cpu.md, "Forward per bucket"). Each block size is
# code of its own, 0.4 s of a program's compile on CPU: one row alone, a few rows in a block
# of 16, and more in a loop over blocks of 48, where a block of SmolLM2's head costs 0.58 ms a
# row (0.88 at 16 rows).
ROW_BLOCK, TAIL_BLOCKS = 48, (1, 16)


def check_gather_shapes(hidden, norm_weight, head, label_ids) -> None:
    if hidden.ndim != 2 or head.ndim != 2 or label_ids.ndim != 2:
        raise ValueError(f"expected hidden [R, H], head [V, H], label_ids [R, K]; got "
                         f"{hidden.shape}, {head.shape}, {label_ids.shape}")
    if head.shape[1] != hidden.shape[1] or norm_weight.shape != (hidden.shape[1],):
        raise ValueError(f"hidden {hidden.shape}, norm {norm_weight.shape} and head "
                         f"{head.shape} disagree on H")
    if label_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"label_ids {label_ids.shape} and hidden {hidden.shape} disagree on R")


def final_norm_label_gather_reference(hidden, norm_weight, head, label_ids, *, eps: float,
                                      with_logsumexp: bool, num_rows=None, num_labels=None,
                                      softcap: float = 0.0):
    """Every row and label: `num_rows` and `num_labels` (the real ones) are not used.
    `softcap`: the logits' (Gemma 2's final soft-cap), before the logsumexp."""
    del num_rows, num_labels
    check_gather_shapes(hidden, norm_weight, head, label_ids)
    x = rms_norm(hidden, norm_weight, eps)
    n_labels, (vocab, width) = label_ids.shape[1], head.shape
    if not with_logsumexp and n_labels * width <= vocab:
        rows = head[label_ids]  # [R, K, H]: only the label rows of the head
        label_logits = jnp.einsum("rh,rkh->rk", x, rows, preferred_element_type=jnp.float32)
        return soft_capped(label_logits, softcap), None
    # The logsumexp needs every logit; so do label sets larger than the head itself.
    logits = soft_capped(jnp.einsum("rh,vh->rv", x, head, preferred_element_type=jnp.float32),
                         softcap)
    label_logits = jnp.take_along_axis(logits, label_ids, axis=1)
    return label_logits, jax.nn.logsumexp(logits, axis=-1) if with_logsumexp else None


def _vocab_major_block(x, head, label_ids, softcap: float):
    """Label logits and logsumexp of normed rows x, the logits computed [V, R] (XLA would turn
    a transpose of them back into [R, V] logits)."""
    logits = soft_capped(jnp.einsum("vh,rh->vr", head, x, preferred_element_type=jnp.float32),
                         softcap)
    label_logits = jnp.take_along_axis(logits, label_ids.T, axis=0).T
    return label_logits, jax.nn.logsumexp(logits, axis=0)


def final_norm_label_gather_xla(hidden, norm_weight, head, label_ids, *, eps: float,
                                with_logsumexp: bool, num_rows, num_labels=None,
                                row_block: int = ROW_BLOCK, softcap: float = 0.0):
    """The reference on the first `num_rows` rows (runtime data): with a logsumexp, where every
    row reads the whole head, one row alone, up to 16 in one block (`TAIL_BLOCKS`), and more
    in a loop over blocks of `row_block`, so that padded rows cost little. Rows past the
    last block are zero. Every label is computed (`num_labels` is not used)."""
    del num_labels
    check_gather_shapes(hidden, norm_weight, head, label_ids)
    kw = dict(eps=eps, with_logsumexp=with_logsumexp, softcap=softcap)
    r, k = label_ids.shape
    if not with_logsumexp:  # a padded row costs K head rows; in a loop XLA CPU copied the head
        logits, _ = final_norm_label_gather_reference(hidden, norm_weight, head, label_ids, **kw)
        return jnp.where(jnp.arange(r)[:, None] < num_rows, logits, 0.0), None
    row_block = min(row_block, r)
    pad = -r % row_block
    x = jnp.pad(rms_norm(hidden, norm_weight, eps), ((0, pad), (0, 0)))
    label_ids = jnp.pad(label_ids, ((0, pad), (0, 0)))

    def block(start, size, out):
        rows = (start, 0)
        logits, lse = _vocab_major_block(jax.lax.dynamic_slice(x, rows, (size, x.shape[1])), head,
                                         jax.lax.dynamic_slice(label_ids, rows, (size, k)),
                                         softcap)
        return (jax.lax.dynamic_update_slice(out[0], logits, rows),
                jax.lax.dynamic_update_slice(out[1], lse, rows[:1]))

    num_rows = jnp.asarray(num_rows, jnp.int32)
    blocks = -(-num_rows // row_block)

    def all_blocks(out):
        return jax.lax.fori_loop(0, blocks, lambda i, o: block(i * row_block, row_block, o), out)

    # With one block the loop's slice would be invariant: XLA hoisted its dot out of the loop
    # and ran it even at 0 trips. A branch of the switch takes that block instead.
    many = all_blocks if r + pad > row_block else functools.partial(block, 0, row_block)
    tails = [s for s in TAIL_BLOCKS if s < row_block]
    branches = [lambda out: out] + [functools.partial(block, 0, s) for s in tails] + [many]
    which = sum((num_rows > s).astype(jnp.int32) for s in [0, *tails])
    out = (jnp.zeros((r + pad, k), jnp.float32), jnp.zeros(r + pad, jnp.float32))
    logits, lse = jax.lax.switch(which, branches, out)
    return logits[:r], lse[:r]
