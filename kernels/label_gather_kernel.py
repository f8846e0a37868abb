"""Fused final RMSNorm + label-logit gather (+ streamed logsumexp): the Pallas TPU kernels.

Same contract as `final_norm_label_gather_reference`; never writes [R, V] logits.
- Labels only (apply_softmax): the K label rows of the head are copied by DMA, one row per
  label, so the [V, H] head is never read whole.
- With logsumexp: the head streams through VMEM in vocabulary tiles; a float32 online
  max/sum gives the logsumexp and label columns are picked inside each tile by comparing
  column ids with the label ids (no dynamic gather). Columns past V are masked.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.label_gather import check_shapes, scale_and_cap
from kernels.rms_norm import rms_norm

_LANES = 128


def _label_rows_kernel(labels_ref, hidden_ref, norm_ref, head_hbm, out_ref, rows_buf, sem, *,
                       eps, n_labels, logit_scale, softcap):
    row_block = hidden_ref.shape[0]
    base = pl.program_id(0) * row_block * n_labels

    def copy(i):
        label = labels_ref[base + i]
        return pltpu.make_async_copy(head_hbm.at[pl.ds(label, 1)], rows_buf.at[pl.ds(i, 1)],
                                     sem.at[0])

    count = row_block * n_labels
    jax.lax.fori_loop(0, count, lambda i, c: (copy(i).start(), c)[1], 0)
    jax.lax.fori_loop(0, count, lambda i, c: (copy(i).wait(), c)[1], 0)
    x = rms_norm(hidden_ref[...], norm_ref[0], eps)
    for r in range(row_block):
        rows = rows_buf[r * n_labels:(r + 1) * n_labels, :]
        logits = jax.lax.dot_general(x[r:r + 1], rows, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        out_ref[r:r + 1, :] = scale_and_cap(logits, logit_scale, softcap)


def _streamed_kernel(hidden_ref, norm_ref, head_ref, labels_ref, out_ref, lse_ref,
                     x_ref, m_ref, s_ref, acc_ref, *, eps, vocab, logit_scale, softcap):
    j = pl.program_id(1)
    tile = head_ref.shape[0]

    @pl.when(j == 0)
    def _():
        x_ref[...] = rms_norm(hidden_ref[...], norm_ref[0], eps)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    logits = jax.lax.dot_general(x_ref[...], head_ref[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    logits = scale_and_cap(logits, logit_scale, softcap)
    col = j * tile + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    valid = col < vocab
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(jnp.where(valid, logits, -jnp.inf), axis=1,
                                         keepdims=True))
    p = jnp.where(valid, jnp.exp(logits - m_next[:, :1]), 0.0)
    s_ref[...] = s_ref[...] * jnp.exp(m_prev - m_next) + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    labels = labels_ref[...]
    for k in range(labels.shape[1]):  # one label at a time: memory stays [rows, tile]
        hit = col == labels[:, k:k + 1]
        acc_ref[:, k:k + 1] += jnp.sum(jnp.where(hit, logits, 0.0), axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        out_ref[...] = acc_ref[...]
        lse_ref[...] = (m_ref[...] + jnp.log(s_ref[...]))[:, :1]


def label_rows_cost(rows: int, labels: int, hidden: int, itemsize: int) -> pl.CostEstimate:
    """Labels only: each row's hidden state and its label rows of the head, read once."""
    return pl.CostEstimate(flops=2 * rows * labels * hidden, transcendentals=rows,
                           bytes_accessed=(rows * labels + rows) * hidden * itemsize
                           + rows * labels * 4)


def streamed_cost(rows: int, labels: int, vocab: int, hidden: int, row_block: int,
                  itemsize: int) -> pl.CostEstimate:
    """Logsumexp: the whole head streamed once per block of `row_block` rows."""
    return pl.CostEstimate(flops=2 * rows * vocab * hidden, transcendentals=rows * vocab,
                           bytes_accessed=pl.cdiv(rows, row_block) * vocab * hidden * itemsize
                           + rows * hidden * itemsize + rows * (labels + 1) * 4)


def streamed_row_block(rows: int, max_stream_rows: int = 256) -> int:
    return min(-(-rows // 8) * 8, max_stream_rows)


def _label_rows(hidden, norm, head, labels, row_block, interpret, **kw):
    r, h = hidden.shape
    k = labels.shape[1]
    kernel = functools.partial(_label_rows_kernel, n_labels=k, **kw)
    return pl.pallas_call(
        kernel, name="label_gather_rows",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(r // row_block,),
            in_specs=[pl.BlockSpec((row_block, h), lambda i, lab: (i, 0)),
                      pl.BlockSpec((1, h), lambda i, lab: (0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((row_block, k), lambda i, lab: (i, 0)),
            scratch_shapes=[pltpu.VMEM((row_block * k, h), head.dtype),
                            pltpu.SemaphoreType.DMA((1,))]),
        out_shape=jax.ShapeDtypeStruct((r, k), jnp.float32),
        cost_estimate=label_rows_cost(r, k, h, head.dtype.itemsize),
        interpret=interpret,
    )(labels.reshape(-1), hidden, norm.reshape(1, h), head)


def _streamed(hidden, norm, head, labels, row_block, vocab_tile, interpret, **kw):
    (r, h), v, k = hidden.shape, head.shape[0], labels.shape[1]
    kernel = functools.partial(_streamed_kernel, vocab=v, **kw)
    rows = lambda i, j: (i, 0)  # noqa: E731
    return pl.pallas_call(
        kernel, name="label_gather_streamed",
        grid=(r // row_block, pl.cdiv(v, vocab_tile)),
        in_specs=[pl.BlockSpec((row_block, h), rows), pl.BlockSpec((1, h), lambda i, j: (0, 0)),
                  pl.BlockSpec((vocab_tile, h), lambda i, j: (j, 0)),
                  pl.BlockSpec((row_block, k), rows)],
        out_specs=[pl.BlockSpec((row_block, k), rows), pl.BlockSpec((row_block, 1), rows)],
        out_shape=[jax.ShapeDtypeStruct((r, k), jnp.float32),
                   jax.ShapeDtypeStruct((r, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((row_block, h), head.dtype),
                        pltpu.VMEM((row_block, _LANES), jnp.float32),
                        pltpu.VMEM((row_block, _LANES), jnp.float32),
                        pltpu.VMEM((row_block, k), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=streamed_cost(r, k, v, h, row_block, head.dtype.itemsize),
        interpret=interpret,
    )(hidden, norm.reshape(1, h), head, labels)


def final_norm_label_gather(hidden, norm_weight, head, label_ids, *, eps: float,
                            with_logsumexp: bool, logit_scale: float = 1.0,
                            softcap: float | None = None, vocab_tile: int = 2048,
                            max_stream_rows: int = 256, interpret=False):
    """Pallas kernels; label logits [R, K] f32 and, with `with_logsumexp`, logsumexp [R] f32.

    The streamed mode reads the head once per block of up to `max_stream_rows` rows."""
    check_shapes(hidden, norm_weight, head, label_ids)
    r = hidden.shape[0]
    row_block = streamed_row_block(r, max_stream_rows) if with_logsumexp else 8
    pad = -r % row_block
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    labels = jnp.pad(label_ids.astype(jnp.int32), ((0, pad), (0, 0)))
    kw = dict(eps=eps, logit_scale=logit_scale, softcap=softcap)
    if not with_logsumexp:
        return _label_rows(hidden, norm_weight, head, labels, row_block, interpret, **kw)[:r], None
    vocab_tile = min(vocab_tile, head.shape[0])  # classifier heads have a handful of rows
    logits, lse = _streamed(hidden, norm_weight, head, labels, row_block, vocab_tile, interpret,
                            **kw)
    return logits[:r], lse[:r, 0]
