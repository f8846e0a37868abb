"""Fused final RMSNorm + label-logit gather (+ streamed logsumexp): the Pallas TPU kernels.

Same contract as `final_norm_label_gather_reference`; never writes [R, V] logits. Label ids
are padded to a fixed count per row: both kernels loop over the first `num_labels` of them
only (a runtime trip count), with labels as a leading dim ([K, 1, rows] or [K, rows, 1]), so
that label k is a dynamic index Mosaic accepts and padded labels cost nothing.
- Labels only (apply_softmax): rows come in label runs, consecutive rows with the same label
  ids (a request's items). For each run and label, the tile of SUBLANES head rows holding
  the label is copied by DMA once (a DMA into a tiled array starts on a tile boundary),
  _CHUNK_TILES tiles to a chunk, the next chunk in flight while this one's logits are
  computed with rows on lanes; each row's column is picked by comparing head rows with its
  label's place in the chunk. The [V, H] head is never read whole. When those tiles would
  outweigh the head, or the head's rows are no whole number of tiles, the streamed kernel
  serves this mode too.
- With logsumexp: the head streams through VMEM in vocabulary tiles; a float32 online
  max/sum gives the logsumexp and label columns are picked inside each tile by comparing
  column ids with the label ids (no dynamic gather). Columns past V are masked. A call takes
  at most _STREAM_LABELS labels, and its VMEM stays within v6e's 32 MiB scoped limit up to
  hidden 16384 in bfloat16 (docs/tpu_v6e.md, "Compiled for TPU v6e").
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.label_gather import check_gather_shapes
from kernels.ragged_paged_attention import soft_capped
from kernels.rms_norm import rms_norm
from kernels.tpu_tiles import LANES, SUBLANES

_CHUNK_TILES = 8  # labels only: head tiles per chunk (docs/kernels.md, "Label gather")
_LABEL_ROWS = 256  # labels only: rows per grid step, on lanes
_HEAD_TILE_BYTES = 4 << 20  # streamed: one vocabulary tile of the head (double-buffered)
_STREAM_LABELS = 64  # streamed: labels of one kernel call (VMEM, see _by_label_groups)


def _next_run(runs_smem, row):
    """The first row after `row` that starts another label run."""
    return jax.lax.while_loop(lambda r: runs_smem[r] == runs_smem[row], lambda r: r + 1, row + 1)


def _start_chunk(c, cursor, copy, labels_smem, runs_smem, n_labels, count, n_pairs):
    """Starts the tile copies of chunk `c`'s (run, label) pairs from `cursor`, (a row of the
    run, label) of its first pair; returns the next chunk's cursor."""
    def pair(i, cursor):
        row, k = cursor
        copy(c, i, labels_smem[row * n_labels + k]).start()
        wrap = k + 1 == count
        row = jax.lax.cond(wrap & (c * _CHUNK_TILES + i + 1 < n_pairs),
                           lambda: _next_run(runs_smem, row), lambda: row)
        return row, jnp.where(wrap, 0, k + 1)
    return jax.lax.fori_loop(0, jnp.minimum(_CHUNK_TILES, n_pairs - c * _CHUNK_TILES), pair,
                             cursor)


def _pick_labels(c, logits, pair_of, labels_ref, out_ref, count):
    """Adds to each row's label logits the ones chunk `c` holds: `logits` is [chunk's head
    rows, rows], and label k of a row sits in tile `pair_of + k - c * _CHUNK_TILES`."""
    head_row = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 0)

    def pick(i, carry):  # the labels with a pair in this chunk
        k = jax.lax.rem(c * _CHUNK_TILES + i, count)
        at = (pair_of + k - c * _CHUNK_TILES) * SUBLANES + jax.lax.rem(labels_ref[k], SUBLANES)
        out_ref[k] += jnp.sum(jnp.where(head_row == at, logits, 0.0), axis=0, keepdims=True)
        return carry

    jax.lax.fori_loop(0, jnp.minimum(_CHUNK_TILES, count), pick, 0)


def _label_tiles_kernel(counts_ref, labels_smem, runs_smem, hidden_ref, norm_ref, labels_ref,
                        runs_ref, head_hbm, out_ref, tiles, sems, *, eps):
    """Grid: blocks of rows. counts_ref: (real rows, real labels). A label run is consecutive
    rows with the same label ids (a request's items); each (run, label) pair of the block
    copies its tile of head rows once, _CHUNK_TILES pairs to a chunk, the next chunk in flight
    while this one's logits `[chunk's head rows, rows]` are computed and picked from."""
    row_block, n_rows, count = labels_ref.shape[2], counts_ref[0], counts_ref[1]
    first = pl.program_id(0) * row_block
    out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    def copy(c, i, label):  # ids are >= 0
        start = pl.multiple_of(jax.lax.div(label, SUBLANES) * SUBLANES, SUBLANES)
        return pltpu.make_async_copy(head_hbm.at[pl.ds(start, SUBLANES)], tiles.at[c % 2, i],
                                     sems.at[c % 2])

    @pl.when((first < n_rows) & (count > 0))
    def _():
        base = runs_smem[first]
        n_pairs = (runs_smem[jnp.minimum(first + row_block, n_rows) - 1] - base + 1) * count
        start = functools.partial(_start_chunk, copy=copy, labels_smem=labels_smem,
                                  runs_smem=runs_smem, n_labels=labels_ref.shape[0],
                                  count=count, n_pairs=n_pairs)
        x = rms_norm(hidden_ref[...], norm_ref[0], eps)
        pair_of = (runs_ref[...] - base) * count  # [1, rows]: the row's pair of label 0

        def chunk(c, cursor):
            cursor = jax.lax.cond((c + 1) * _CHUNK_TILES < n_pairs,
                                  lambda: start(c + 1, cursor), lambda: cursor)
            in_chunk = jnp.minimum(_CHUNK_TILES, n_pairs - c * _CHUNK_TILES)
            jax.lax.fori_loop(0, in_chunk, lambda i, _: copy(c, i, 0).wait(), None)
            chunk_rows = tiles[c % 2].reshape(_CHUNK_TILES * SUBLANES, -1)
            logits = jax.lax.dot_general(chunk_rows, x, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
            _pick_labels(c, logits, pair_of, labels_ref, out_ref, count)
            return cursor

        jax.lax.fori_loop(0, pl.cdiv(n_pairs, _CHUNK_TILES), chunk, start(0, (first, 0)))
        real = first + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 2) < n_rows
        out_ref[...] = jnp.where(real, out_ref[...], 0.0)


def _streamed_kernel(counts_ref, hidden_ref, norm_ref, head_ref, labels_ref, out_ref, lse_ref,
                     x_ref, m_ref, s_ref, acc_ref, *, eps, vocab, softcap):
    """Grid: (row blocks, vocabulary tiles). counts_ref: (real rows, real labels)."""
    j = pl.program_id(1)
    tile = head_ref.shape[0]

    def each_label(body):  # the real labels only: the wrapper zeroes the rest
        def step(k, carry):
            body(k)
            return carry
        jax.lax.fori_loop(0, counts_ref[1], step, 0)

    def zero(k):
        acc_ref[k] = jnp.zeros(acc_ref.shape[1:], jnp.float32)

    def write(k):
        out_ref[k] = acc_ref[k]

    @pl.when(j == 0)
    def _():
        def norm_rows(c, carry):  # a [rows, hidden] float32 value: 8 MiB of VMEM at 256 x 8192
            rows = pl.ds(pl.multiple_of(c * SUBLANES, SUBLANES), SUBLANES)
            x_ref[rows, :] = rms_norm(hidden_ref[rows, :], norm_ref[0], eps)
            return carry

        jax.lax.fori_loop(0, x_ref.shape[0] // SUBLANES, norm_rows, 0)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        each_label(zero)

    logits = soft_capped(jax.lax.dot_general(x_ref[...], head_ref[...], (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32), softcap)
    col = j * tile + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    valid = col < vocab
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(jnp.where(valid, logits, -jnp.inf), axis=1,
                                         keepdims=True))
    p = jnp.where(valid, jnp.exp(logits - m_next[:, :1]), 0.0)
    s_ref[...] = s_ref[...] * jnp.exp(m_prev - m_next) + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next

    def pick(k, carry):  # one label at a time: memory stays [rows, tile]
        hit = col == labels_ref[k]
        acc_ref[k] += jnp.sum(jnp.where(hit, logits, 0.0), axis=1, keepdims=True)
        return carry

    jax.lax.fori_loop(0, counts_ref[1], pick, 0)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        each_label(write)
        lse_ref[...] = (m_ref[...] + jnp.log(s_ref[...]))[:, :1]


def label_rows_cost(rows: int, labels: int, hidden: int, itemsize: int,
                    runs: int = 1) -> pl.CostEstimate:
    """Labels only: each row's hidden state, and for each label of each of `runs` label runs
    the tile of head rows that holds it, read once."""
    tiles = runs * labels * SUBLANES
    return pl.CostEstimate(flops=2 * rows * tiles * hidden, transcendentals=rows,
                           bytes_accessed=(tiles + rows) * hidden * itemsize + rows * labels * 4)


def label_groups(labels: int, group: int = _STREAM_LABELS) -> list[int]:
    """Streamed: the labels of each kernel call (`_by_label_groups`)."""
    return [min(group, labels - first) for first in range(0, max(labels, 1), group)]


def streamed_cost(rows: int, labels: int, vocab: int, hidden: int, row_block: int,
                  itemsize: int) -> pl.CostEstimate:
    """Logsumexp: the whole head streamed once per block of `row_block` rows, in each kernel
    call of `label_groups(labels)` (one call in a kernel's own estimate)."""
    calls = len(label_groups(labels))
    head_reads = calls * pl.cdiv(rows, row_block)
    return pl.CostEstimate(flops=calls * 2 * rows * vocab * hidden,
                           transcendentals=calls * rows * vocab,
                           bytes_accessed=head_reads * vocab * hidden * itemsize
                           + calls * rows * hidden * itemsize + rows * (labels + calls) * 4)


def label_tiles_pay(runs, labels, vocab: int):
    """Labels only: whether copying each label run's label tiles of head rows reads less of the
    head than streaming it once (runtime values: the real runs and labels)."""
    return runs * labels * SUBLANES < vocab


def label_runs(labels, num_rows):
    """[R] int32: each row's label run, consecutive rows with the same label ids numbered from
    0; rows from `num_rows` on stay in the last run."""
    rows = labels.shape[0]
    changes = jnp.any(labels[1:] != labels[:-1], axis=1) & (jnp.arange(1, rows) < num_rows)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(changes, dtype=jnp.int32)])


def label_row_block(rows: int, most: int = _LABEL_ROWS) -> int:
    """Labels only: rows per grid step; a block of fewer than `most` is all the rows."""
    return min(-(-rows // SUBLANES) * SUBLANES, most)


def head_tile_rows(vocab: int, hidden: int, itemsize: int, most: int = 2048) -> int:
    """Streamed: head rows per vocabulary tile, at most `most` and _HEAD_TILE_BYTES (a wide
    float32 head would overflow VMEM), in whole lane tiles of logits; a smaller head is one
    tile (classifier heads have a handful of rows)."""
    fits = max(LANES, _HEAD_TILE_BYTES // (hidden * itemsize) // LANES * LANES)
    return min(most, fits, vocab)


def streamed_row_block(rows: int, max_stream_rows: int = 256) -> int:
    return min(-(-rows // 8) * 8, max_stream_rows)


def _pad_rows(x, block: int):
    """[R, ...] with zero rows added up to a multiple of `block`."""
    return jnp.pad(x, ((0, -x.shape[0] % block), (0, 0)))


def _by_label(labels):
    """[R, K] -> [K, R, 1]: label k is a leading index, each row on its own sublane."""
    return labels.T[:, :, None]


def _label_tiles(counts, hidden, norm, head, labels, runs, row_block, interpret, **kw):
    (r, h), k = hidden.shape, labels.shape[1]
    rows = lambda i, *_: (i, 0)  # noqa: E731
    on_lanes = lambda i, *_: (0, 0, i)  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_label_tiles_kernel, **kw), name="label_gather_rows",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(r // row_block,),
            in_specs=[pl.BlockSpec((row_block, h), rows),
                      pl.BlockSpec((1, h), lambda i, *_: (0, 0)),
                      pl.BlockSpec((k, 1, row_block), on_lanes),
                      pl.BlockSpec((1, row_block), lambda i, *_: (0, i)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((k, 1, row_block), on_lanes),
            scratch_shapes=[pltpu.VMEM((2, _CHUNK_TILES, SUBLANES, h), head.dtype),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct((k, 1, r), jnp.float32),
        cost_estimate=label_rows_cost(r, k, h, head.dtype.itemsize),
        interpret=interpret,
    )(counts, labels.reshape(-1), runs, hidden, norm.reshape(1, h), labels.T[:, None, :],
      runs[None, :], head)
    return out[:, 0, :].T


def _streamed(counts, *, hidden, norm, head, labels, row_block, vocab_tile, interpret, **kw):
    (r, h), v, k = hidden.shape, head.shape[0], labels.shape[1]
    rows = lambda i, j, *_: (i, 0)  # noqa: E731
    by_label = lambda i, j, *_: (0, i, 0)  # noqa: E731
    logits, lse = pl.pallas_call(
        functools.partial(_streamed_kernel, vocab=v, **kw), name="label_gather_streamed",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(r // row_block, pl.cdiv(v, vocab_tile)),
            in_specs=[pl.BlockSpec((row_block, h), rows),
                      pl.BlockSpec((1, h), lambda i, j, *_: (0, 0)),
                      pl.BlockSpec((vocab_tile, h), lambda i, j, *_: (j, 0)),
                      pl.BlockSpec((k, row_block, 1), by_label)],
            out_specs=[pl.BlockSpec((k, row_block, 1), by_label),
                       pl.BlockSpec((row_block, 1), rows)],
            scratch_shapes=[pltpu.VMEM((row_block, h), head.dtype),
                            pltpu.VMEM((row_block, LANES), jnp.float32),
                            pltpu.VMEM((row_block, LANES), jnp.float32),
                            pltpu.VMEM((k, row_block, 1), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((k, r, 1), jnp.float32),
                   jax.ShapeDtypeStruct((r, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=streamed_cost(r, k, v, h, row_block, head.dtype.itemsize),
        interpret=interpret,
    )(counts, hidden, norm.reshape(1, h), head, _by_label(labels))
    real = jnp.arange(k)[:, None] < counts[1]  # labels past the real ones: never written
    return jnp.where(real, logits[:, :, 0], 0.0).T, lse[:, 0]


def _by_label_groups(streamed, counts, labels, group: int):
    """The streamed kernel on up to `group` labels at a time: its VMEM holds a row block's
    labels and logits lane-padded, about 0.3 MiB a label at 256 rows. The first call gives
    the logsumexp; a later group holding no real label (counts[1], a runtime value) skips
    the head."""
    def call(first):
        part = labels[:, first:first + group]
        return streamed(counts.at[1].set(jnp.clip(counts[1] - first, 0, part.shape[1])),
                        labels=part)

    logits, lse = call(0)
    for first in range(group, labels.shape[1], group):
        zeros = jnp.zeros((labels.shape[0], min(group, labels.shape[1] - first)), jnp.float32)
        logits = jnp.concatenate([logits, jax.lax.cond(
            counts[1] > first, lambda f=first: call(f)[0], lambda z=zeros: z)], axis=1)
    return logits, lse


def final_norm_label_gather(hidden, norm_weight, head, label_ids, *, eps: float,
                            with_logsumexp: bool, num_rows=None, num_labels=None,
                            vocab_tile: int = 2048, max_stream_rows: int = 256,
                            max_stream_labels: int = _STREAM_LABELS,
                            max_label_rows: int = _LABEL_ROWS, interpret=False,
                            softcap: float = 0.0):
    """Pallas kernels; label logits [R, K] f32 and, with `with_logsumexp`, logsumexp [R] f32.

    `num_rows`, `num_labels` (runtime data; None: all): the real rows and the real labels of
    any row; label columns past `num_labels` come back 0. The streamed mode reads the head
    once per block of up to `max_stream_rows` rows, and once more per further group of
    `max_stream_labels` labels that holds a real label; labels only, a grid step takes up to
    `max_label_rows` rows (a multiple of 128 where there are more rows)."""
    check_gather_shapes(hidden, norm_weight, head, label_ids)
    (r, h), (vocab, k) = hidden.shape, (head.shape[0], label_ids.shape[1])
    counts = jnp.stack([jnp.asarray(r if num_rows is None else num_rows, jnp.int32),
                        jnp.asarray(k if num_labels is None else num_labels, jnp.int32)])
    kw = dict(eps=eps)
    labels = label_ids.astype(jnp.int32)

    def streamed():
        row_block = streamed_row_block(r, max_stream_rows)
        call = functools.partial(_streamed, hidden=_pad_rows(hidden, row_block), norm=norm_weight,
                                 head=head, row_block=row_block, interpret=interpret,
                                 vocab_tile=head_tile_rows(vocab, h, head.dtype.itemsize,
                                                           vocab_tile), softcap=softcap, **kw)
        logits, lse = _by_label_groups(call, counts, _pad_rows(labels, row_block),
                                       max_stream_labels)
        return logits[:r], lse[:r]

    if with_logsumexp:
        return streamed()
    if vocab % SUBLANES:  # the head's rows are no whole number of tiles
        return streamed()[0], None

    runs = label_runs(labels, counts[0])
    row_block = label_row_block(r, max_label_rows)

    def tiles():  # a label's logit capped alone: no logsumexp here
        return soft_capped(_label_tiles(counts, _pad_rows(hidden, row_block), norm_weight, head,
                                        _pad_rows(labels, row_block),
                                        jnp.pad(runs, (0, -r % row_block), mode="edge"),
                                        row_block, interpret, **kw)[:r], softcap)

    n_runs = runs[jnp.maximum(counts[0], 1) - 1] + 1
    return jax.lax.cond(label_tiles_pay(n_runs, counts[1], vocab), tiles,
                        lambda: streamed()[0]), None
