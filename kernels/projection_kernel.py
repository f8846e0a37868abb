"""A layer's projections as Pallas TPU matmuls, and their plain-JAX references: x [T, in]
times one or more weights [in, out] of one shape (k and v; the MLP's gate and up), each
product finished in VMEM (a bias, the gate's SiLU times up, or q's or k's norm and RoPE) and
written once, in x's dtype or float32.

In the compiled v6e schedule XLA's dots at a layer's shapes run at 1.8-2.2x the MXU's bound
(hidden 1024, 2048 tokens; docs/tpu_v6e.md). Here a grid step takes a block of tokens and a
block of output features over the whole contraction, so no partial sum goes back and forth
between steps: 1.09-1.17x in the same schedule. The blocks keep either the tokens or the
weights whole in VMEM where they fit (`projection_blocks`), so each is read from HBM once,
and the weights are read from the layer loop's stacks where they lie. k's and v's products
can go straight into their pages of the KV pool instead of out (`PageWrite`), a block of rows
a page. int8 weights (W8A8, kernels.int8) multiply x quantized per token in VMEM (after its
norm, where the kernel norms it; before the call, once, where a step holds a block of the
columns), into int32, dequantized before the rest of the epilogue.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.head_tiles import (
    head_tile,
    heads_from_tiles,
    heads_in_tiles,
    packed_heads,
    tile_spread,
)
from kernels.int8 import dequantized, hadamard_blocks, int8_matmul, quantize_tokens
from kernels.quantize_kernel import quantized_rows
from kernels.rms_norm import rms_norm
from kernels.rope_kernel import HeadRope, lane_group, norm_rope_lanes, norm_rope_reference
from kernels.tpu_tiles import LANES, SUBLANES, row_block

_TOKENS_WHOLE_BYTES = 8 << 20  # x kept whole in VMEM: read once, the weights streamed
_TOKEN_BLOCK_BYTES = 16 << 20  # else, with the weights streamed too, a step's block of x
_WEIGHTS_WHOLE_BYTES = 16 << 20  # else the weights kept whole: read once, the tokens streamed
_BLOCK_WEIGHT_BYTES = 4 << 20  # a step's weight blocks when the weights stream
_PRODUCT_BYTES = 16 << 20  # a step's float32 products
_MAX_ROWS = 512  # tokens a step's products take at once: the MXU's rate holds from 256
_LEAST_ROWS = 2 * SUBLANES  # a bfloat16 tile's rows
_MIN_COLUMN_STEPS = 4  # when the weights stream, so that their DMAs overlap the MXU's work
_MIN_COLUMNS = 256  # the MXU's width: narrower blocks run it at half rate
_VMEM_LIMIT_BYTES = 64 << 20  # the blocks above double-buffered, with the products
MIN_TOKENS = 512  # projection_kernel_applies
NORM_MIN_STEPS = 4  # norm_fits
# The first step's weights come in chunks of columns, its products starting after the first:
# the wider the chunks, the longer its fill; the narrower, the more waits in its listing
# (each drains the MXU's pipeline), so after the first it waits for FIRST_STEP_WAIT_CHUNKS
# chunks at a time (docs/tpu_v6e.md)
FIRST_CHUNK_COLUMNS = 256
FIRST_STEP_WAIT_CHUNKS = 2


@dataclasses.dataclass(frozen=True)
class ProjectionBlocks:
    rows: int     # tokens a grid step
    columns: int  # output features a grid step, of each weight

    def steps(self, tokens: int, width: int) -> int:
        return (tokens // self.rows) * (width // self.columns)

    def all_columns(self, width: int) -> bool:
        """Whether a step holds all of the weights' columns: they are read in once."""
        return self.columns == width


def projection_blocks(tokens: int, depth: int, width: int, weights: int,
                      itemsize: int, weight_itemsize: int | None = None) -> ProjectionBlocks:
    """Blocks of x [tokens, depth] and of `weights` weights [depth, width]: the weights whole
    where they fit and the tokens take two steps or more (each read once, and the first step
    waits for one block of x, not all of it); else the tokens whole where they fit (x read
    once, each weight block once, in at least four blocks of at least the MXU's 256 columns
    where the width allows); else the weights whole where they fit; else both in blocks, the
    tokens' as large as fit (the weights read once per block of tokens). `itemsize`: x's;
    `weight_itemsize`: the weights' (int8's 1), by default x's."""
    weight_bytes = weights * depth * (weight_itemsize or itemsize)  # a column's
    # a deep contraction's weight blocks grow past _BLOCK_WEIGHT_BYTES to the MXU's width
    block_weight_bytes = max(_BLOCK_WEIGHT_BYTES, weight_bytes * _MIN_COLUMNS)

    def columns(rows: int, most: int) -> int:
        return _columns(width, lambda c: c <= most and weight_bytes * c <= block_weight_bytes
                        and rows * c * weights * 4 <= _PRODUCT_BYTES)
    streamed = (weight_bytes * width <= _WEIGHTS_WHOLE_BYTES
                and row_block(tokens, lambda r: r <= _MAX_ROWS
                              and r * width * weights * 4 <= _PRODUCT_BYTES, least=_LEAST_ROWS))
    if streamed and tokens // streamed >= 2:
        return ProjectionBlocks(streamed, width)
    if tokens * depth * itemsize <= _TOKENS_WHOLE_BYTES:
        return ProjectionBlocks(tokens, columns(tokens, max(width // _MIN_COLUMN_STEPS,
                                                            _MIN_COLUMNS)))
    if streamed:
        return ProjectionBlocks(streamed, width)
    rows = row_block(tokens, lambda r: r * depth * itemsize <= _TOKEN_BLOCK_BYTES,
                     least=_LEAST_ROWS)
    return ProjectionBlocks(rows, columns(rows, width))


def _columns(width: int, fits) -> int:
    """The widest whole number of lane tiles dividing `width` that `fits` (at least one)."""
    if width % LANES:
        return width
    tiles = width // LANES
    return LANES * max(t for t in range(1, tiles + 1) if tiles % t == 0
                       and (t == 1 or fits(t * LANES)))


def first_chunk_columns(width: int, blocks: ProjectionBlocks) -> int:
    """Columns of the first weight block's chunks: where a step holds all the weights,
    FIRST_CHUNK_COLUMNS (or the widest lane tiles dividing the width up to them); else the
    block whole."""
    if not blocks.all_columns(width):
        return blocks.columns
    return _columns(width, lambda c: c <= FIRST_CHUNK_COLUMNS)


def first_step_waits(chunks: int) -> list[range]:
    """The first step's chunks of weights in the groups it waits for, each just before the
    group's first products: the first chunk alone, then FIRST_STEP_WAIT_CHUNKS at a time."""
    return [range(1)] + [range(c, min(c + FIRST_STEP_WAIT_CHUNKS, chunks))
                         for c in range(1, chunks, FIRST_STEP_WAIT_CHUNKS)]


def x_comes_quantized(blocks: ProjectionBlocks, width: int, int8: bool) -> bool:
    """Whether an int8 call quantizes x (after its norm, where it takes one) before the
    kernel, in kernels.quantize_kernel's (`quantize_kernel_name`): where a step holds a block
    of the columns, so that no block of x is quantized again at each of them (a step holding
    them all quantizes its block in VMEM)."""
    return int8 and not blocks.all_columns(width)


def quantize_kernel_name(call: str) -> str:
    """The name of the kernel quantizing x before the projection kernel `call`."""
    return f"quantize_{call}"


def projection_kernel_applies(tokens: int, shapes) -> bool:
    """Whether the kernel takes `tokens` times weights of these [in, out] shapes: weights of
    whole lane tiles both ways (XLA tiles other widths' stacks in a layout the kernel's
    operands do not take, and copies them to it every forward), and enough tokens that the
    MXU rather than reading the weights bounds the products (v6e's ridge is 560 FLOPs a
    byte, a token's product 1 FLOP a weight byte): below, XLA's dots hide under the weights'
    DMA with the layer's other ops, and a kernel would add its own (docs/tpu_v6e.md)."""
    return tokens >= MIN_TOKENS and all(d % LANES == 0 for shape in shapes
                                         for d in shape[-2:])


def projection_bytes(tokens: int, depth: int, width: int, weights: int, outputs: int,
                     itemsize: int, out_itemsize: int, blocks: ProjectionBlocks,
                     rope_group: int = 0, weight_itemsize: int | None = None,
                     spread: int = 1, x_spread: int = 1) -> int:
    """HBM bytes the kernel moves: x once (its block changes only with the token block), the
    weights once if whole, else once per token block (in `weight_itemsize`, default x's),
    each of `outputs` once (`spread` times wider with heads a lane tile each, as x is
    `x_spread` times), and with RoPE its two float32 tables [tokens, rope_group] once."""
    weight_reads = 1 if blocks.all_columns(width) else tokens // blocks.rows
    weight_itemsize = weight_itemsize or itemsize
    return (tokens * depth * x_spread * itemsize
            + weight_reads * weights * depth * width * weight_itemsize
            + outputs * tokens * width * spread * out_itemsize + 2 * tokens * rope_group * 4)


def silu(x):
    """x * sigmoid(x) as x / (1 + exp(-x)), the model's: XLA CPU's logistic takes twice as
    long (docs/performance_cpu.md, "Forward per bucket")."""
    return x / (1 + jnp.exp(-x))


def gelu_tanh(x):
    """GELU with the tanh approximation: Gemma's GeGLU (HF's gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}  # by model.config.ModelConfig.activation


def finish_gated(products, out_dtype, activation: str = "silu"):
    """activation(gate) times up, each rounded to `out_dtype` first, as the model's XLA ops
    do."""
    gate, up = (p.astype(out_dtype) for p in products)
    return (ACTIVATIONS[activation](gate.astype(jnp.float32)).astype(out_dtype) * up,)


def _finish_each(products, biases, out_dtype):
    return tuple((p if b is None else p + b.astype(jnp.float32)).astype(out_dtype)
                 for p, b in zip(products, biases))


def added(residual, y):
    """residual + y in y's dtype, rounded once, as the model's add of the two."""
    return (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(y.dtype)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a call's kernel takes after x (and its scales, where it comes quantized): a stack
    for each of `groups` (its count of weights), a bias for each weight (where `biased`),
    RoPE's two tables and norm weight (where `rope` is (head_dim, eps, normed)), a block of
    the residual stream, x's norm weight, the weights' int8 scales, then its outputs (or,
    `paged`, the pools); a step sees the weights' blocks in place of the stacks (and the
    staging buffers in place of the pools)."""
    groups: tuple[int, ...]
    biased: bool
    gated: bool
    rope: tuple[int, float, bool] | None
    paged: bool = False  # the products go to pages (PageWrite), not to outputs
    residual: bool = False  # a block of the residual stream follows the RoPE operands
    x_norm: float | None = None  # x is RMS-normed first (its eps; its weight after the residual)
    activation: str = "silu"  # of a gated call's gate
    int8: bool = False  # int8 weights: x quantized per token; their scales [n, out] last
    x_quantized: bool = False  # x comes int8, its per-token scales [T, 1] right after it
    hadamard: int = 0  # a gated call's product times hadamard(n) in each block of n columns
    tile_heads: int = 0  # the outputs' heads of this many lanes, each stored in a lane tile
    x_tile_heads: int = 0  # x's heads of this many lanes come a lane tile each: packed first

    @property
    def weights(self) -> int:
        return sum(self.groups)

    def split(self, refs) -> tuple:
        """(weights, biases, rope operands, residual, x's norm weight, the weights' scales,
        outputs) of `refs`: lists."""
        counts = (self.weights, self.weights if self.biased else 0,
                  0 if self.rope is None else 2 + self.rope[2], int(self.residual),
                  int(self.x_norm is not None), int(self.int8))
        parts, start = [], 0
        for n in counts:
            parts.append(list(refs[start:start + n]))
            start += n
        return (*parts, list(refs[start:]))


def sub_block_rows(rows: int) -> int:
    """Rows of a step's sub-blocks (`_step`)."""
    return row_block(rows, lambda r: r <= _MAX_ROWS, least=_LEAST_ROWS)


def _step(x_ref, *refs, layout: _Layout, chunk: int, ready=None, after=None,
          x_scale_ref=None):
    """One block of tokens times one block of each weight's columns, finished: the first
    product normed and rotated where the call has RoPE. The block's rows go through in
    sub-blocks of at most `_MAX_ROWS` (where a power of two divides them), one after another
    in the listing, so that the compiler overlaps one sub-block's vector epilogue with the
    next one's products (at 2048 tokens, q's step with its norm and RoPE fell from 8,824
    bundles to 6,914; docs/tpu_v6e.md); each sub-block's columns in chunks of `chunk`, the
    first sub-block's after `ready(chunk index)`; `after(first_row, rows)` follows each
    sub-block. `x_scale_ref`: x's per-token scales, where x comes quantized."""
    w_refs, b_refs, rope_refs, residual, x_norm, scales, out_refs = layout.split(refs)
    block = sub_block_rows(x_ref.shape[0])
    for start in range(0, x_ref.shape[0], block):
        rows = pl.ds(start, block)
        waits = ready if start == 0 else None
        if waits is not None:  # before x's norm, which then overlaps the first products
            waits(0)
        if x_scale_ref is None:
            x = x_ref[rows, :]
            if layout.x_tile_heads:
                x = packed_heads(x, layout.x_tile_heads)
            if x_norm:
                x = rms_norm(x, x_norm[0][...], layout.x_norm).astype(x.dtype)
            operand = _operand(x, scales)
        else:
            operand = x_ref[rows, :], x_scale_ref[rows, :], scales[0]
        product = functools.partial(_products, *operand)
        chunks = [pl.ds(first, chunk) for first in range(0, w_refs[0].shape[-1], chunk)]
        products = product(w_refs, chunks[0])
        for c, columns in enumerate(chunks):
            following = None
            if c + 1 < len(chunks):  # the next chunk's wait before this one's epilogue
                if waits is not None:
                    waits(c + 1)
                following = product(w_refs, chunks[c + 1])
            _finish(products, b_refs, rope_refs, residual, out_refs, rows, columns, layout)
            products = following
        if after is not None:
            after(start, block)


def _operand(x, scales: list) -> tuple:
    """(x, its per-token scales, the weights' scales ref): x quantized where the weights are
    int8 (`scales` holds their ref), else (x, None, None)."""
    if not scales:
        return x, None, None
    return (*quantize_tokens(x, axis=1), scales[0])


def _products(x, x_scale, w_scales, w_refs, columns) -> list:
    """float32 products; int8 ones dequantized (the weights' scales [n, out] by row)."""
    if w_scales is None:
        return [jnp.dot(x, w[:, columns], preferred_element_type=jnp.float32) for w in w_refs]
    return [dequantized(jnp.dot(x, w[:, columns], preferred_element_type=jnp.int32), x_scale,
                        w_scales[pl.ds(k, 1), columns], feature_major=False)
            for k, w in enumerate(w_refs)]


def _finish(products, b_refs, rope_refs, residual, out_refs, rows, columns, layout: _Layout):
    dtype = out_refs[0].dtype
    outs = (finish_gated(products, dtype, layout.activation) if layout.gated
            else _finish_each(products,
                              [b[:, columns] for b in b_refs] or [None] * len(products), dtype))
    if layout.hadamard:
        outs = (hadamard_blocks_in_vmem(outs[0], layout.hadamard),)
    if residual:
        outs = (added(residual[0][rows, columns], outs[0]),)
    for i, (out, y) in enumerate(zip(out_refs, outs)):
        if i == 0 and layout.rope is not None:
            _store_rotated(out, y, *rope_refs, rows=rows, first_lane=columns.start,
                           rope=layout.rope, tile_heads=layout.tile_heads)
        else:
            _store_heads(out, rows, columns.start, y, layout.tile_heads)


def hadamard_blocks_in_vmem(y, n: int):
    """y [rows, columns] times hadamard(n) in each block of n columns, as
    kernels.int8.hadamard_blocks: a dot of each block on the MXU, with the +-1 matrix made
    from iotas (H[i, j] = -1 where i & j has an odd count of bits)."""
    i, j = (jax.lax.broadcasted_iota(jnp.int32, (n, n), axis) for axis in (0, 1))
    both, odd = i & j, jnp.zeros((n, n), jnp.int32)
    for bit in range(n.bit_length() - 1):
        odd = odd ^ ((both >> bit) & 1)
    h = (1 - 2 * odd).astype(jnp.float32).astype(y.dtype)
    blocks = [jnp.dot(y[:, k:k + n], h, preferred_element_type=jnp.float32)
              for k in range(0, y.shape[1], n)]
    return jnp.concatenate(blocks, axis=1).astype(y.dtype)


def _store(out, rows, first_lane: int, y) -> None:
    """y [rows, width] into `out` from lane `first_lane` on: an output block [rows, columns],
    or a step's staging buffer for pages, heads apart [heads, pages, page_size, head_dim]."""
    if out.ndim == 2:
        out[rows, pl.ds(first_lane, y.shape[1])] = y
        return
    page_size, d = out.shape[-2:]
    pages = pl.ds(rows.start // page_size, rows.size // page_size)
    for k in range(y.shape[1] // d):
        out[first_lane // d + k, pages] = y[:, k * d:(k + 1) * d].reshape(
            pages.size, page_size, d)


def _store_heads(out, rows, first_lane: int, y, head_dim: int) -> None:
    """y [rows, width] as `_store` takes it, or with `head_dim`, each of its heads of that many
    lanes into a lane tile of its own, zeros after it (the KV pool's and the attention's
    layout): from tile first_lane / head_dim on."""
    if not head_dim:
        _store(out, rows, first_lane, y)
        return
    for k in range(y.shape[1] // head_dim):
        _store(out, rows, (first_lane // head_dim + k) * LANES, head_tile(y, k, head_dim))


def _store_rotated(out, y, cos_ref, sin_ref, *norm_ref, rows, first_lane: int,
                   rope: tuple[int, float, bool], tile_heads: int = 0):
    """y (the product of `rows` in out's dtype: what the norm and RoPE kernel would read)
    normed and rotated a lane group at a time, as that kernel does."""
    head_dim, eps, _ = rope
    cos, sin = cos_ref[rows, :], sin_ref[rows, :]
    weight = norm_ref[0][...] if norm_ref else None
    group = cos.shape[-1]
    for g in range(y.shape[-1] // group):
        x = norm_rope_lanes(y[:, g * group:(g + 1) * group].astype(jnp.float32), cos, sin,
                            weight, head_dim=head_dim, eps=eps, dtype=out.dtype)
        _store_heads(out, rows, first_lane + g * group, x.astype(out.dtype), tile_heads)


def _kernel(*refs, layout: _Layout, chunk: int, single_step: bool):
    """The weights are read where they lie in the stack (XLA's slice of a layer out of a
    stack fed to a kernel is a copy of it): a step's block of columns is copied in while the
    step before computes, or once where one block holds them all. The first block comes in
    chunks of `chunk` columns, each waited for just before its products: the first step
    starts after one chunk, not the whole block."""
    # with pages: the blocks' pages, and which steps' pages follow each other
    layer_ref, *page_refs = refs[:1 + 2 * layout.paged]
    x_ref, *refs = refs[1 + 2 * layout.paged:]
    x_scale_ref = refs.pop(0) if layout.x_quantized else None
    w_hbm, rest = refs[:len(layout.groups)], refs[len(layout.groups):]
    if layout.paged:  # then: the pools in (aliased), the pools out, the staging buffer
        *step_refs, _, _, k_pages, v_pages, w_vmem, copied, first, staging, page_sems = rest
    else:
        *step_refs, w_vmem, copied, first = rest
    slots, columns = w_vmem.shape[0], w_vmem.shape[-1]
    j, blocks = pl.program_id(1), pl.num_programs(1)
    step, steps = pl.program_id(0) * blocks + j, pl.num_programs(0) * blocks

    sources = [(w, i) for w, n in zip(w_hbm, layout.groups) for i in range(n)]

    def copies(block, slot, sems, cols=pl.ds(0, columns)):
        return [pltpu.make_async_copy(
            w.at[layer_ref[0], i, :, pl.ds(block * columns + cols.start, cols.size)],
            w_vmem.at[slot, k, :, cols], sems.at[k]) for k, (w, i) in enumerate(sources)]

    def first_chunk(c):
        return copies(0, 0, first.at[c], pl.ds(c * chunk, chunk))

    @pl.when(step == 0)
    def _():
        for c in range(columns // chunk):
            for copy in first_chunk(c):
                copy.start()
    slot = step % slots
    if slots == 2:
        @pl.when(step + 1 < steps)
        def _():
            for c in copies((j + 1) % blocks, 1 - slot, copied.at[1 - slot]):
                c.start()

        @pl.when(step > 0)
        def _():
            for c in copies(j, slot, copied.at[slot]):
                c.wait()

    groups = {group.start: group for group in first_step_waits(columns // chunk)}

    def ready(c):
        for k in groups.get(c, ()):
            for copy in first_chunk(k):
                copy.wait()
    weights = [w_vmem.at[slot, k] for k in range(layout.weights)]

    def compute(*step_refs, after=None):
        """Each step's products, the first step's each after its chunk of weights: two
        bodies, so that no wait stands between the other steps' chunks."""
        run = functools.partial(_step, x_ref, *weights, *step_refs, layout=layout,
                                chunk=chunk, after=after, x_scale_ref=x_scale_ref)
        if chunk == columns:
            pl.when(step == 0)(lambda: ready(0))
            run()
        elif single_step:
            run(ready=ready)
        else:
            pl.when(step == 0)(functools.partial(run, ready=ready))
            pl.when(step > 0)(run)
    if not layout.paged:
        compute(*step_refs)
        return
    page_slot = step % 2
    pages = _PageCopies(layer_ref[0], *page_refs, staging, (k_pages, v_pages), page_sems,
                        pl.program_id(0), j)
    pl.when(step >= 2)(lambda: pages.wait(page_slot))  # the slot's copies of two steps ago
    compute(*step_refs, *pages.buffers(page_slot),
            after=functools.partial(pages.start, page_slot))

    @pl.when(step == steps - 1)
    def _():
        pl.when(step >= 1)(lambda: pages.wait(1 - page_slot))
        pages.wait(page_slot)


@dataclasses.dataclass(frozen=True)
class _PageCopies:
    """A step's k and v, staged heads apart in VMEM ([2 slots, k and v, heads, the step's
    pages, page_size, D]), each sub-block copied into its pages as soon as it is stored (the
    scalar work of the copies then overlaps the next sub-block's): in one copy each for k
    and v where the step's pages follow each other in the pool, else a copy a page (64
    starts a step of 512 rows at pages of 16, a branch of some 900 bundles that nothing
    overlaps; docs/tpu_v6e.md). A slot is reused two steps later, after one wait for all of
    its copies (a copy of the slot's size on their semaphore)."""
    layer: jax.Array
    block_pages: object  # SMEM [T / page_size]
    consecutive: object  # SMEM [row steps]: whether a step's pages follow each other
    staging: object
    pools: tuple
    sems: object
    row_block: jax.Array     # the step's grid position
    column_block: jax.Array

    def buffers(self, slot) -> list:
        return [self.staging.at[slot, n] for n in range(2)]

    def start(self, slot, first_row: int, rows: int) -> None:
        heads, step_pages, page_size = self.staging.shape[2:5]
        first = first_row // page_size  # the sub-block's first page of the step
        n_pages, step_first = rows // page_size, self.row_block * step_pages + first
        head = pl.ds(self.column_block * heads, heads)
        run = self.consecutive[self.row_block] != 0

        @pl.when(run)
        def _():
            for n, pool in enumerate(self.pools):
                pltpu.make_async_copy(
                    self.staging.at[slot, n, :, pl.ds(first, n_pages)],
                    pool.at[self.layer, head, pl.ds(self.block_pages[step_first], n_pages)],
                    self.sems.at[slot]).start()

        @pl.when(jnp.logical_not(run))
        def _():
            for b in range(n_pages):
                page = self.block_pages[step_first + b]
                for n, pool in enumerate(self.pools):
                    pltpu.make_async_copy(self.staging.at[slot, n, :, first + b],
                                          pool.at[self.layer, head, page],
                                          self.sems.at[slot]).start()

    def wait(self, slot) -> None:
        """All of a slot's copies: one wait of the slot's size on their semaphore."""
        buffer = self.staging.at[slot]
        pltpu.make_async_copy(buffer, buffer, self.sems.at[slot]).wait()


def check_projection_shapes(x, weights: tuple, biases: tuple, layer, scales: tuple = ()
                            ) -> None:
    matrices = {w.shape[-2:] for w in weights}
    ranks = {w.ndim for w in weights} <= ({2} if layer is None else {3, 4})
    (depth, width), = matrices if len(matrices) == 1 else ((None, None),)
    int8 = {w.dtype == jnp.int8 for w in weights}
    if (x.ndim != 2 or not weights or not ranks or depth != x.shape[1]
            or (biases and (len(biases) != _weight_count(weights)
                            or any(b.shape != (width,) for b in biases)))
            or int8 != {bool(scales)} or (scales and (
                len(scales) != _weight_count(weights)
                or any(s.shape != (width,) or s.dtype != jnp.float32 for s in scales)))):
        raise ValueError(f"expected x [T, in], weights of one shape [in, out] (with a layer, "
                         f"stacks [layers, in, out] or groups [layers, n, in, out]) and a bias "
                         f"[out] for each or none, and int8 weights' float32 scales [out] "
                         f"(at the layer) for each, got x {x.shape}, weights "
                         f"{[w.shape for w in weights]} of "
                         f"{sorted({w.dtype.name for w in weights})}, biases "
                         f"{[b.shape for b in biases]}, scales {[s.shape for s in scales]}, "
                         f"layer {layer}")


def _weight_count(weights: tuple) -> int:
    return sum(w.shape[1] if w.ndim == 4 else 1 for w in weights)


def _groups(weights: tuple, layer) -> tuple:
    """The weights as the kernel reads them, stacks of groups [layers, n, in, out]."""
    if layer is None:
        return tuple(w[None, None] for w in weights)
    return tuple(w if w.ndim == 4 else w[:, None] for w in weights)


def _call(x, weights: tuple, biases: tuple, layer, *, gated: bool, out_dtype, name: str,
          blocks: ProjectionBlocks | None, rope: HeadRope | None, interpret,
          pages: "PageWrite | None" = None, residual=None, x_norm: "InputNorm | None" = None,
          activation: str = "silu", scales: tuple = (), hadamard: int = 0,
          tile_heads: int = 0, x_tile_heads: int = 0):
    x_spread = _check_x_tile_heads(x_tile_heads, x, x_norm)
    packed = x if x_spread == 1 else jax.ShapeDtypeStruct(
        (x.shape[0], x.shape[1] // x_spread), x.dtype)
    check_projection_shapes(packed, weights, biases, layer, scales)
    stacks, layer = _groups(weights, layer), 0 if layer is None else layer
    groups = tuple(w.shape[1] for w in stacks)
    n, tokens, width = sum(groups), x.shape[0], weights[0].shape[-1]
    depth = x.shape[1] // x_spread
    blocks = blocks or call_blocks(tokens, depth, width, n, x.dtype.itemsize,
                                   pages and pages.k_pages.shape[3], x_norm is not None,
                                   weights[0].dtype.itemsize)
    if tokens % blocks.rows or width % blocks.columns:
        raise ValueError(f"blocks {blocks} must divide x {x.shape} and the weights' {width} "
                         "columns")
    rope_operands = _rope_operands(rope, tokens, width, blocks, gated)
    outputs = 1 if gated else n
    spread = _check_tile_heads(tile_heads, width, rope, gated or residual is not None)
    if pages is not None:
        pages.check(tokens, width * spread, outputs,
                    ProjectionBlocks(blocks.rows, blocks.columns * spread), out_dtype)
    if residual is not None:
        _check_residual(residual, (tokens, width), out_dtype, outputs, pages is not None)
    x_scale = ()  # x's per-token scales, where it comes quantized (and normed)
    if x_comes_quantized(blocks, width, bool(scales)):
        if x_spread > 1:  # the quantize kernel takes x packed
            x, x_spread, x_tile_heads = heads_from_tiles(x, x_tile_heads), 1, 0
        x, scale = quantized_rows(x, *((x_norm.weight, x_norm.eps) if x_norm else ()),
                                  name=quantize_kernel_name(name), interpret=interpret)
        x_scale, x_norm = (scale,), None
    if x_norm is not None:
        x_norm.check(depth, blocks, width)
    slots = 1 if blocks.all_columns(width) else 2
    chunk = first_chunk_columns(width, blocks)
    if hadamard and chunk % hadamard:
        raise ValueError(f"Hadamard blocks of {hadamard} columns must divide the products' "
                         f"chunks of {chunk} ({blocks})")
    layout = _Layout(groups, bool(biases), gated,
                     rope and (rope.head_dim, rope.eps, rope.norm is not None),
                     pages is not None, residual is not None, x_norm and x_norm.eps, activation,
                     bool(scales), bool(x_scale), hadamard, tile_heads, x_tile_heads)
    scalars = [jnp.asarray(layer, jnp.int32).reshape(1)] + (
        [] if pages is None else [pages.block_pages.astype(jnp.int32),
                                  consecutive_steps(pages.block_pages,
                                                    blocks.rows // pages.k_pages.shape[3])])
    operands = [x, *x_scale, *map(in_hbm, stacks), *(b.reshape(1, -1) for b in biases),
                *rope_operands,
                *([] if residual is None else [residual]),
                *([] if x_norm is None else [x_norm.weight.reshape(1, depth)]),
                *([jnp.stack(scales)] if scales else [])]
    out = _Outputs(pages, ProjectionBlocks(blocks.rows, blocks.columns * spread),
                   (tokens, width * spread), out_dtype, outputs)
    return pl.pallas_call(
        functools.partial(_kernel, layout=layout, chunk=chunk,
                          single_step=blocks.steps(tokens, width) == 1),
        name=name,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(tokens // blocks.rows, width // blocks.columns),
            in_specs=[pl.BlockSpec((blocks.rows, x.shape[1]), lambda i, j, *_: (i, 0))]
            + [pl.BlockSpec((blocks.rows, 1), lambda i, j, *_: (i, 0))] * len(x_scale)
            + [pl.BlockSpec(memory_space=pltpu.HBM)] * len(stacks)
            + [pl.BlockSpec((1, blocks.columns), lambda i, j, *_: (0, j))] * len(biases)
            + _rope_specs(rope, blocks.rows) + out.residual_specs(residual)
            + ([] if x_norm is None else [pl.BlockSpec((1, depth), lambda i, j, *_: (0, 0))])
            + ([pl.BlockSpec((n, blocks.columns), lambda i, j, *_: (0, j))] if scales else [])
            + out.in_specs(),
            out_specs=out.specs(),
            scratch_shapes=[pltpu.VMEM((slots, n, depth, blocks.columns), weights[0].dtype),
                            pltpu.SemaphoreType.DMA((slots, n)),
                            pltpu.SemaphoreType.DMA((blocks.columns // chunk, n))]
            + out.scratch()),
        out_shape=out.shapes(),
        input_output_aliases=out.aliases(len(scalars) + len(operands)),
        # sequential: a step copies in the next step's weights (and writes the pages of the
        # step before last)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT_BYTES),
        cost_estimate=pl.CostEstimate(
            flops=2 * tokens * depth * width * n,
            transcendentals=tokens * width if gated else 0,
            bytes_accessed=projection_bytes(
                tokens, depth, width, n, outputs, x.dtype.itemsize,
                jnp.dtype(out_dtype).itemsize, blocks,
                lane_group(rope.head_dim) if rope else 0, weights[0].dtype.itemsize, spread,
                x_spread)),
        interpret=interpret,
    )(*scalars, *operands, *out.operands())


def in_hbm(stack):
    """A weight stack the kernel copies from where it lies, kept in HBM: else XLA's memory
    space assignment may copy a whole stack into VMEM every layer (Qwen2.5-0.5B's [24, 896,
    896] q weights, 38.5 MB, with the MLP kernel beside; docs/tpu_v6e.md). A call outside a
    traced program takes it as it is (no program moves it; the constraint does not run
    eagerly)."""
    if not isinstance(stack, jax.core.Tracer):
        return stack
    return pltpu.with_memory_space_constraint(stack, pltpu.HBM)


def _check_tile_heads(head_dim: int, width: int, rope: HeadRope | None,
                      gated_or_residual: bool) -> int:
    """How many times wider the outputs are written with heads of `head_dim` lanes a lane tile
    each (1 without)."""
    if head_dim and (gated_or_residual or (rope is not None and rope.head_dim != head_dim)):
        raise ValueError(f"heads of {head_dim} lanes a lane tile each take RoPE of that head "
                         f"dim (got {getattr(rope, 'head_dim', None)}); not a gated call's or "
                         "one with a residual")
    return tile_spread(head_dim, width)


def _check_x_tile_heads(head_dim: int, x, x_norm: "InputNorm | None") -> int:
    """How many times wider x comes than its packed heads (1: as it is)."""
    if not head_dim:
        return 1
    if x.ndim != 2 or x.shape[1] % LANES or x_norm is not None:
        raise ValueError(f"x's heads of {head_dim} lanes a lane tile each take x [T, heads x "
                         f"{LANES}] and no x norm, got x {x.shape}")
    return tile_spread(head_dim, x.shape[1] // LANES * head_dim)


def consecutive_steps(block_pages, pages_per_step: int):
    """Per step of rows, 1 where its blocks' pages follow each other in the pool (a copy
    each for k and v takes them all), else 0; int32 [T / page_size / pages_per_step]."""
    runs = jnp.reshape(block_pages, (-1, pages_per_step))
    following = runs == runs[:, :1] + jnp.arange(pages_per_step)
    return jnp.all(following, axis=1).astype(jnp.int32)


def _check_residual(residual, shape: tuple, dtype, outputs: int, paged: bool) -> None:
    if outputs != 1 or paged or residual.shape != shape or residual.dtype != jnp.dtype(dtype):
        raise ValueError(f"a residual {list(shape)} in {dtype} takes one output of that shape, "
                         f"got {residual.shape} {residual.dtype} for {outputs} outputs"
                         f"{' to pages' if paged else ''}")


def row_stream_blocks(tokens: int, depth: int, width: int, weights: int, itemsize: int,
                      least: int = _LEAST_ROWS) -> ProjectionBlocks | None:
    """Blocks of every column and at most `_MAX_ROWS` rows (one sub-block), a whole number
    of `least` rows, where the weights (of `itemsize`) fit VMEM whole (None where they do
    not): each block of x is then read, and finished, in one step."""
    if weights * depth * width * itemsize > _WEIGHTS_WHOLE_BYTES:
        return None
    rows = row_block(tokens, lambda r: r <= _MAX_ROWS, least=least)
    if rows % least:  # `least` not a power of two: whole multiples of it, fewest steps
        rows = max(r for r in range(least, max(_MAX_ROWS, least) + 1, least)
                   if tokens % r == 0)
    return ProjectionBlocks(rows, width)


def page_write_blocks(tokens: int, depth: int, width: int, itemsize: int,
                      page_size: int, weight_itemsize: int | None = None) -> ProjectionBlocks:
    """Blocks of k's and v's projection into pages (PageWrite): a step takes every head, so
    that a block of rows goes to its page in one copy for k and one for v (row_stream_blocks,
    whole pages), or else the projection's own blocks."""
    return (row_stream_blocks(tokens, depth, width, 2, weight_itemsize or itemsize, page_size)
            or projection_blocks(tokens, depth, width, 2, itemsize, weight_itemsize))


def call_blocks(tokens: int, depth: int, width: int, weights: int, itemsize: int,
                page_size: int | None = None, normed: bool = False,
                weight_itemsize: int | None = None) -> ProjectionBlocks:
    """A call's blocks where its caller gives none: into pages of `page_size` rows, the
    pages' (page_write_blocks); with x's norm, every column a step where the weights fit, so
    that each block of x is normed once (InputNorm.check refuses the rest); else the
    projection's own."""
    if page_size is not None:
        return page_write_blocks(tokens, depth, width, itemsize, page_size, weight_itemsize)
    own = projection_blocks(tokens, depth, width, weights, itemsize, weight_itemsize)
    if not normed:
        return own
    return row_stream_blocks(tokens, depth, width, weights, weight_itemsize or itemsize) or own


@dataclasses.dataclass(frozen=True)
class InputNorm:
    """x's RMSNorm (the layer's input norm, kernels.rms_norm: statistics in float32, the
    product in the weight's dtype) applied to each block of x in VMEM before the products:
    its weight [in] and eps. A step must hold every column, so that a block of x is normed
    once (`norm_fits`); int8 weights in blocks of columns take x normed as it is quantized,
    before the call (`x_comes_quantized`)."""
    weight: jax.Array
    eps: float

    def check(self, depth: int, blocks: ProjectionBlocks, width: int) -> None:
        if self.weight.shape != (depth,) or not blocks.all_columns(width):
            raise ValueError(f"x's norm takes a weight [{depth}] and steps of all {width} "
                             f"columns, got {self.weight.shape} and {blocks}")


def norm_fits(tokens: int, depth: int, width: int, weights: int, itemsize: int) -> bool:
    """Whether a call's kernel norms x itself: its weights whole in VMEM, so that a step
    holds every column, and at least NORM_MIN_STEPS steps of rows, over which the weights'
    one copy, at the first, is spread (at 512 tokens, one step, gate and up's 12 MiB of
    weights outlast its products: Qwen3-0.6B's forward 1.786 -> 1.828 ms in the v6e
    estimate, with the first step's weights in chunks). `itemsize`: the weights'. int8
    weights (1) that do not fit whole take x normed as it is quantized, before the call."""
    blocks = row_stream_blocks(tokens, depth, width, weights, itemsize)
    if blocks is None:
        return itemsize == 1
    return tokens // blocks.rows >= NORM_MIN_STEPS


@dataclasses.dataclass(frozen=True)
class PageWrite:
    """k's and v's products written into their pages of the KV pool instead of returned:
    the pools [layers, Hkv, num_pages, page_size, D] (updated in place, at the call's layer)
    and `block_pages` [T / page_size], the page each block of page_size rows of x fills. A
    page's rows are one such block (each sequence's new tokens start on one:
    runtime.batch_builder, page-aligned), so nothing moves between the projection's layout
    and the pages'. Every block is copied: a padding block's page is one nobody reads (the
    pool's last: model.decoder.kv_pool_shape)."""
    k_pages: jax.Array
    v_pages: jax.Array
    block_pages: jax.Array

    def check(self, tokens: int, width: int, outputs: int, blocks: ProjectionBlocks,
              out_dtype) -> None:
        _, heads, _, page_size, d = self.k_pages.shape
        if (self.v_pages.shape != self.k_pages.shape or outputs != 2 or width != heads * d
                or d % LANES or tokens % page_size or blocks.rows % page_size
                or blocks.columns % d or self.block_pages.shape != (tokens // page_size,)
                or self.k_pages.dtype != jnp.dtype(out_dtype)):
            raise ValueError(
                f"pages {self.k_pages.shape} and {self.v_pages.shape} ({self.k_pages.dtype}) "
                f"take k and v [{tokens}, heads x D] of whole lane tiles ({outputs} outputs "
                f"of {width} in {out_dtype}) in blocks of whole pages and heads ({blocks}), "
                f"and block_pages [{tokens} / page_size], got {self.block_pages.shape}")


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """A call's outputs: blocks of [T, width] products, or (with `pages`) the pools, with
    their staging buffer and semaphores."""
    pages: PageWrite | None
    blocks: ProjectionBlocks
    shape: tuple[int, int]
    dtype: object
    count: int

    def in_specs(self) -> list:
        return [] if self.pages is None else [pl.BlockSpec(memory_space=pl.ANY)] * 2

    def residual_specs(self, residual) -> list:
        """The residual's blocks are the output's."""
        return [] if residual is None else self.specs()

    def specs(self) -> list:
        if self.pages is None:
            return [pl.BlockSpec((self.blocks.rows, self.blocks.columns),
                                 lambda i, j, *_: (i, j))] * self.count
        return [pl.BlockSpec(memory_space=pl.ANY)] * 2

    def shapes(self) -> list:
        if self.pages is None:
            return [jax.ShapeDtypeStruct(self.shape, self.dtype)] * self.count
        return [jax.ShapeDtypeStruct(p.shape, p.dtype)
                for p in (self.pages.k_pages, self.pages.v_pages)]

    def scratch(self) -> list:
        if self.pages is None:
            return []
        d = self.pages.k_pages.shape[-1]
        page_size = self.pages.k_pages.shape[3]
        return [pltpu.VMEM((2, 2, self.blocks.columns // d, self.blocks.rows // page_size,
                            page_size, d), self.dtype),
                pltpu.SemaphoreType.DMA((2,))]

    def operands(self) -> tuple:
        return () if self.pages is None else (self.pages.k_pages, self.pages.v_pages)

    def aliases(self, first: int) -> dict:
        return {} if self.pages is None else {first: 0, first + 1: 1}


def _rope_specs(rope: HeadRope | None, rows: int) -> list:
    """A block of the tables' rows a step (the tokens'), and the norm weight whole."""
    if rope is None:
        return []
    table = pl.BlockSpec((rows, lane_group(rope.head_dim)), lambda i, j, *_: (i, 0))
    norm = pl.BlockSpec((1, rope.head_dim), lambda i, j, *_: (0, 0))
    return [table, table] + ([norm] if rope.norm is not None else [])


def _rope_operands(rope: HeadRope | None, tokens: int, width: int, blocks: ProjectionBlocks,
                   gated: bool) -> tuple:
    """The tables [T, group] and the norm weight [1, head_dim] (where given), checked."""
    if rope is None:
        return ()
    rope.check(tokens, width)
    if gated or blocks.columns % lane_group(rope.head_dim):
        raise ValueError(f"RoPE needs a projection's column blocks of whole lane groups "
                         f"({lane_group(rope.head_dim)}), got {blocks}, gated {gated}")
    return (rope.cos, rope.sin) + (() if rope.norm is None else
                                   (rope.norm.reshape(1, rope.head_dim),))


def project(x, weights: tuple, biases: tuple = (), *, layer=None, out_dtype=None,
            rope: HeadRope | None = None, pages: PageWrite | None = None, residual=None,
            x_norm: InputNorm | None = None, scales: tuple = (), name: str = "project",
            blocks: ProjectionBlocks | None = None, tile_heads: int = 0,
            x_tile_heads: int = 0, interpret=False) -> tuple:
    """x @ w (+ b) for each weight [in, out] (and its bias [out], for all or none), in
    `out_dtype` (default x's). With `layer` (an int32 scalar), each weight is a stack
    [layers, in, out] read at that layer, or a group of n weights [layers, n, in, out] (k's and
    v's). With `rope`, the first product's heads (q, or k of k and v) are normed and rotated in
    VMEM. With `pages`, k's and v's products go into their pages: returns the pools (k, v).
    With `residual` [T, out] (out_dtype), one weight's product is added to it (the layer's
    residual stream). With `x_norm`, x is RMS-normed first. int8 weights take `scales`, a
    float32 [out] for each weight (at the layer), and x is quantized per token (W8A8,
    kernels.int8). With `tile_heads` (a head dim under 128 lanes that divides them), each
    output's heads go each into a lane tile of its own, zeros after them: [T, heads x 128],
    the KV pool's and the attention kernel's layout; with `x_tile_heads`, x comes so (the
    attention's output) and its heads are packed first. `name`: the kernel's, one per call
    site (a study prices each)."""
    return tuple(_call(x, tuple(weights), tuple(biases), layer, gated=False,
                       out_dtype=out_dtype or x.dtype, name=name, blocks=blocks, rope=rope,
                       interpret=interpret, pages=pages, residual=residual, x_norm=x_norm,
                       scales=tuple(scales), tile_heads=tile_heads,
                       x_tile_heads=x_tile_heads))


def gated_up(x, w_gate, w_up, *, layer=None, x_norm: InputNorm | None = None,
             scales: tuple = (), name: str = "gate_up", blocks: ProjectionBlocks | None = None,
             interpret=False, activation: str = "silu", hadamard: int = 0):
    """activation(x @ w_gate) * (x @ w_up), in x's dtype (SiLU, or Gemma's GeGLU): the MLP's
    input to its down projection; with `hadamard` n, then times hadamard(n) in each block of
    n columns (an int8 model's: kernels.int8.hadamard_blocks). `layer`, `x_norm` and
    `scales` as in `project`."""
    (out,) = _call(x, (w_gate, w_up), (), layer, gated=True, out_dtype=x.dtype, name=name,
                   blocks=blocks, rope=None, interpret=interpret, x_norm=x_norm,
                   activation=activation, scales=tuple(scales), hadamard=hadamard)
    return out


def _at_layer(weights: tuple, layer) -> tuple:
    """Each weight [in, out] at the layer (a group's one by one)."""
    if layer is None:
        return weights
    return tuple(m for w in weights for m in (w[layer] if w.ndim == 4 else w[layer][None]))


def project_reference(x, weights: tuple, biases: tuple = (), *, layer=None, out_dtype=None,
                      rope: HeadRope | None = None, pages: PageWrite | None = None,
                      residual=None, x_norm: InputNorm | None = None, scales: tuple = (),
                      name: str = "project", blocks=None, tile_heads: int = 0,
                      x_tile_heads: int = 0, interpret=False) -> tuple:
    """Plain JAX, the same contract: the model's RMSNorm and XLA dots (and the norm and RoPE
    kernel's reference), and the pages written block by block."""
    del name, blocks, interpret
    if _check_x_tile_heads(x_tile_heads, x, x_norm) > 1:
        x = heads_from_tiles(x, x_tile_heads)
    check_projection_shapes(x, tuple(weights), tuple(biases), layer, tuple(scales))
    x = _normed_reference(x, x_norm)
    products = _products_reference(x, _at_layer(tuple(weights), layer), tuple(scales))
    outs = _finish_each(products, list(biases) or [None] * len(products), out_dtype or x.dtype)
    if rope is not None:
        rope.check(*outs[0].shape)
        outs = (norm_rope_reference(outs[0], rope.cos, rope.sin, rope.norm,
                                    head_dim=rope.head_dim, eps=rope.eps),) + outs[1:]
    if residual is not None:
        outs = (residual + outs[0],)
    if tile_heads:
        _check_tile_heads(tile_heads, outs[0].shape[1], rope, residual is not None)
        outs = tuple(heads_in_tiles(y, tile_heads) for y in outs)
    return outs if pages is None else _pages_reference(outs, pages, layer)


def _pages_reference(outs: tuple, pages: PageWrite, layer) -> tuple:
    """The pools with each block of rows written into its page (where several padding blocks
    share a page, any one of them)."""
    _, heads, _, page_size, d = pages.k_pages.shape
    layer = 0 if layer is None else layer

    def put(pool, y):
        blocks = y.reshape(-1, page_size, heads, d).transpose(0, 2, 1, 3)
        return pool.at[layer, :, pages.block_pages].set(blocks)
    return put(pages.k_pages, outs[0]), put(pages.v_pages, outs[1])


def gated_up_reference(x, w_gate, w_up, *, layer=None, x_norm: InputNorm | None = None,
                       scales: tuple = (), name: str = "gate_up", blocks=None,
                       interpret=False, activation: str = "silu", hadamard: int = 0):
    """Plain JAX, the same contract."""
    del name, blocks, interpret
    check_projection_shapes(x, (w_gate, w_up), (), layer, tuple(scales))
    x = _normed_reference(x, x_norm)
    products = _products_reference(x, _at_layer((w_gate, w_up), layer), tuple(scales))
    out = finish_gated(products, x.dtype, activation)[0]
    return hadamard_blocks(out, hadamard, axis=1) if hadamard else out


def _products_reference(x, weights: tuple, scales: tuple) -> list:
    """XLA's dots; int8 weights' as kernels.int8's."""
    if not scales:
        return [jnp.dot(x, w, preferred_element_type=jnp.float32) for w in weights]
    return [int8_matmul(x, w, s) for w, s in zip(weights, scales)]


def _normed_reference(x, x_norm: InputNorm | None):
    return x if x_norm is None else rms_norm(x, x_norm.weight, x_norm.eps).astype(x.dtype)
