"""The layer after its attention as one Pallas TPU kernel, and its plain-JAX reference: the
output projection and its residual add (`out_and_mlp`), then the MLP: x's RMSNorm, gate and
up, SiLU(gate) times up, the down projection and the residual add (`mlp` alone, where the
output projection's partial sums are all-reduced first). A block of 512 tokens a step, the
weights whole in VMEM, copied in once during the first step. int8 weights (W8A8,
kernels.int8) multiply their inputs quantized per token in VMEM: the attention's output, x
after its norm, and the gated product after its Hadamard blocks, whose whole rows are there.
Heads narrower than a lane tile come from the attention a tile each, packed in VMEM.

As three projection kernels (kernels.projection_kernel's output projection, gate and up, then
down), each call paid its own fill and drain that nothing overlaps: a block written to HBM
after its last step and read back as the next call's first block, its first step waiting for
its weights, and four more grid steps (a Qwen3-0.6B layer at 2048 tokens: 76.9 us in the v6e
estimate, 62.8 here; docs/tpu_v6e.md, "The layer after attention in one kernel"). Here a
block's residual stream and gated product stay in VMEM, and the first step's products start
after a chunk of the weights, the rest arriving while they run.
"""
import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.head_tiles import heads_from_tiles, packed_heads, tile_spread
from kernels.int8 import dequantized, quantize_tokens
from kernels.projection_kernel import (
    MIN_TOKENS,
    NORM_MIN_STEPS,
    InputNorm,
    ProjectionBlocks,
    added,
    finish_gated,
    first_chunk_columns,
    first_step_waits,
    gated_up_reference,
    hadamard_blocks_in_vmem,
    in_hbm,
    project_reference,
    sub_block_rows,
)
from kernels.rms_norm import rms_norm
from kernels.tpu_tiles import LANES

# the weights, one copy each, beside a step's blocks and products: Llama-3.2-1B's in int8 (48
# MiB; 52 with its output projection's) within v5e's and v6e's 128 MiB of VMEM a core
_WEIGHTS_BYTES = 56 << 20
_VMEM_LIMIT_BYTES = 110 << 20


def mlp_rows(tokens: int) -> int:
    """Tokens a step: one sub-block of the projections' (their MXU rate holds from 256)."""
    return sub_block_rows(tokens)


def mlp_kernel_applies(tokens: int, hidden: int, inner: int, itemsize: int,
                       out_depth: int = 0) -> bool:
    """Whether the kernel takes this MLP (after an output projection of `out_depth` inputs,
    where it takes one): widths of whole lane tiles, the weights whole in VMEM, and at least
    NORM_MIN_STEPS steps, over which the weights' one copy, in the first, is spread (as the
    projection kernel's norm: `norm_fits`)."""
    return (tokens >= MIN_TOKENS and hidden % LANES == 0 and inner % LANES == 0
            and out_depth % LANES == 0
            and (3 * inner + out_depth) * hidden * itemsize <= _WEIGHTS_BYTES
            and tokens // mlp_rows(tokens) >= NORM_MIN_STEPS)


def mlp_bytes(tokens: int, hidden: int, inner: int, itemsize: int, out_itemsize: int,
              residual: bool, out_depth: int = 0, weight_itemsize: int | None = None,
              x_spread: int = 1) -> int:
    """HBM bytes the kernel moves: its input (x, or the attention's output, `x_spread` times
    wider with heads a lane tile each), the weights (in `weight_itemsize`, by default x's) and
    the output once, and the residual where it adds one."""
    depth = (out_depth or hidden) * x_spread
    return (tokens * (depth + hidden * residual) * itemsize + (3 * inner + out_depth) * hidden
            * (weight_itemsize or itemsize) + tokens * hidden * out_itemsize)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a call's kernel takes: its input, the output projection's stack (`out_chunk`, its
    columns a copy, where it takes one), the MLP's stacks, the residual's block, x's norm
    weight (its `eps`), the output; then its scratch."""
    chunk: int      # gate's and up's columns, down's rows, a copy
    out_chunk: int  # 0: no output projection
    residual: bool
    eps: float | None
    int8: bool = False  # int8 weights; their scales: gate's and up's [2, inner], then wo's
                        # (where it takes wo) and down's [1 or 2, hidden]
    hadamard: int = 0   # the gated product times hadamard(n) in each run of n columns
    x_tile_heads: int = 0  # the attention's heads of this many lanes come a lane tile each

    def split(self, refs) -> tuple:
        """(input, wo, (gate, up, down), residual, norm weight, scales, output, scratch) of
        refs, a missing one None (scales: (inner's, hidden's) refs)."""
        refs = list(refs)
        x = refs.pop(0)
        wo = refs.pop(0) if self.out_chunk else None
        stacks = tuple(refs.pop(0) for _ in range(3))
        res = refs.pop(0) if self.residual else None
        norm = refs.pop(0) if self.eps is not None else None
        scales = (refs.pop(0), refs.pop(0)) if self.int8 else None
        return x, wo, stacks, res, norm, scales, refs.pop(0), refs


def _kernel(layer_ref, *refs, layout: _Layout):
    x_ref, wo_hbm, stacks, res_ref, norm_ref, scales, out_ref, scratch = layout.split(refs)
    gate, up, down, act, sems, *out_scratch = scratch
    step, layer = pl.program_id(0), layer_ref[0]
    chunk = layout.chunk
    columns = [pl.ds(c * chunk, chunk) for c in range(gate.shape[-1] // chunk)]

    def chunk_copies(c, parts=(0, 1, 2)):  # gate's and up's columns, down's rows
        ends = ((stacks[0].at[layer, :, columns[c]], gate.at[:, columns[c]]),
                (stacks[1].at[layer, :, columns[c]], up.at[:, columns[c]]),
                (stacks[2].at[layer, columns[c]], down.at[columns[c]]))
        return [pltpu.make_async_copy(*ends[k], sems.at[c, k]) for k in parts]
    out = (_OutProjection(wo_hbm, *out_scratch, layer, layout.out_chunk,
                          None if scales is None else scales[1], layout.x_tile_heads)
           if layout.out_chunk else None)

    @pl.when(step == 0)
    def _():  # in the order the first step needs them
        for copy in out.copies() if out is not None else ():
            copy.start()
        for c in range(len(columns)):
            for copy in chunk_copies(c):
                copy.start()

    waits = {group.start: group for group in first_step_waits(len(columns))}

    def wait(c, first: bool, parts: tuple):
        """The first step's wait, at chunk c, for its group's gate and up (or down)."""
        for k in waits.get(c, ()) if first else ():
            for copy in chunk_copies(k, parts):
                copy.wait()

    def products(x, c, first: bool):
        wait(c, first, (0, 1))
        if scales is None:
            return [jnp.dot(x, w[:, columns[c]], preferred_element_type=jnp.float32)
                    for w in (gate, up)]
        (xq, x_scale), inner_scales = x, scales[0]
        return [dequantized(jnp.dot(xq, w[:, columns[c]], preferred_element_type=jnp.int32),
                            x_scale, inner_scales[pl.ds(k, 1), columns[c]], False)
                for k, w in enumerate((gate, up))]

    def gated(current):
        y = finish_gated(current, act.dtype)[0]
        return hadamard_blocks_in_vmem(y, layout.hadamard) if layout.hadamard else y

    def down_int8(first: bool):
        """down's int8 product of the gated product quantized per token, whose rows are
        whole only now: in the first step a chunk of rows at a time, after its chunk of the
        weights (int32 sums: exact in any order)."""
        aq, a_scale = quantize_tokens(act[...], axis=1)
        if not first:
            acc = jnp.dot(aq, down[...], preferred_element_type=jnp.int32)
        else:
            acc = None
            for c in range(len(columns)):
                wait(c, first, (2,))
                part = jnp.dot(aq[:, c * chunk:(c + 1) * chunk], down[columns[c], :],
                               preferred_element_type=jnp.int32)
                acc = part if acc is None else acc + part
        hidden_scales = scales[1]
        return dequantized(acc, a_scale, hidden_scales[pl.ds(hidden_scales.shape[0] - 1, 1), :],
                           False)

    def run(first: bool):
        """The first step takes down's product a chunk of rows at a time, each after its
        chunk of the weights; the others in one product over the step's whole gated
        product (a float32 sum of chunks costs the VPU an add a chunk, which the first
        step's wait for the weights hides)."""
        residual = out.residual(x_ref, res_ref, first) if out is not None else res_ref
        x = residual[...] if out is not None else x_ref[...]
        if norm_ref is not None:
            x = rms_norm(x, norm_ref[...], layout.eps).astype(x.dtype)
        if scales is not None:
            x = quantize_tokens(x, axis=1)
        y, following = None, products(x, 0, first)
        for c, cols in enumerate(columns):  # the next chunk's products before this epilogue
            current = following
            following = products(x, c + 1, first) if c + 1 < len(columns) else None
            act[:, cols] = gated(current)
            if first and scales is None:  # down's rows waited for only here: the last arrive last
                wait(c, first, (2,))
                part = jnp.dot(act[:, cols], down[cols, :],
                               preferred_element_type=jnp.float32)
                y = part if y is None else y + part
        if scales is not None:
            y = down_int8(first)
        elif not first:
            y = jnp.dot(act[...], down[...], preferred_element_type=jnp.float32)
        y = y.astype(out_ref.dtype)
        out_ref[...] = added(residual[...], y) if residual is not None else y

    pl.when(step == 0)(functools.partial(run, True))
    pl.when(step > 0)(functools.partial(run, False))


@dataclasses.dataclass(frozen=True)
class _OutProjection:
    """The attention's output projection in the kernel: its weights [in, hidden] copied in a
    chunk of columns at a time, and the block's residual stream after it, in VMEM."""
    wo_hbm: object
    wo: object
    sems: object
    stream: object  # [rows, hidden]: residual + attn @ wo
    layer: object
    chunk: int
    scales: object  # int8 wo's: a ref whose first row is its scales [hidden]; else None
    tile_heads: int  # the attention's heads of this many lanes come a lane tile each

    def _columns(self) -> list:
        return [pl.ds(c * self.chunk, self.chunk) for c in range(self.wo.shape[1] // self.chunk)]

    def _copy(self, c: int, cols):
        return pltpu.make_async_copy(self.wo_hbm.at[self.layer, :, cols], self.wo.at[:, cols],
                                     self.sems.at[c])

    def copies(self) -> list:
        return [self._copy(c, cols) for c, cols in enumerate(self._columns())]

    def residual(self, attn_ref, res_ref, first: bool):
        """The stream ref: each chunk's product rounded to its dtype before the residual add,
        as the projection kernel's; the first step's each after its chunk of the weights."""
        attn = attn_ref[...]
        if self.tile_heads:
            attn = packed_heads(attn, self.tile_heads)
        if self.scales is not None:
            attn, attn_scale = quantize_tokens(attn, axis=1)
        for c, cols in enumerate(self._columns()):
            if first:
                self._copy(c, cols).wait()
            if self.scales is None:
                y = jnp.dot(attn, self.wo[:, cols], preferred_element_type=jnp.float32)
            else:
                y = dequantized(jnp.dot(attn, self.wo[:, cols], preferred_element_type=jnp.int32),
                                attn_scale, self.scales[pl.ds(0, 1), cols], False)
            self.stream[:, cols] = added(res_ref[:, cols], y.astype(self.stream.dtype))
        return self.stream


def check_mlp_shapes(x, w_gate, w_up, w_down, layer) -> None:
    rank = 2 if layer is None else 3
    hidden = x.shape[-1] if x.ndim == 2 else None
    inner = w_gate.shape[-1]
    if (x.ndim != 2 or {w.ndim for w in (w_gate, w_up, w_down)} != {rank}
            or w_gate.shape != w_up.shape or w_gate.shape[-2] != hidden
            or w_down.shape[-2:] != (inner, hidden)
            or w_down.shape[:-2] != w_gate.shape[:-2]):
        raise ValueError(f"expected x [T, hidden], gate and up [in, inner] and down [inner, "
                         f"hidden] (with a layer, stacks [layers, ...] of them), got x "
                         f"{x.shape}, gate {w_gate.shape}, up {w_up.shape}, down "
                         f"{w_down.shape}, layer {layer}")


def _check_out_projection(attn, wo, residual, layer, x_tile_heads: int = 0) -> None:
    spread = tile_spread(x_tile_heads, wo.shape[-2])
    if (attn.ndim != 2 or wo.ndim != (2 if layer is None else 3)
            or wo.shape[-2:] != (attn.shape[1] // spread, residual.shape[1])
            or residual.shape[0] != attn.shape[0] or residual.dtype != attn.dtype):
        raise ValueError(f"expected the attention's output [T, in] ({spread} times wider with "
                         f"heads of {x_tile_heads} a lane tile each), wo [in, hidden] (with a "
                         f"layer, a stack [layers, in, hidden]) and a residual [T, hidden] in "
                         f"its dtype, got attn {attn.shape} {attn.dtype}, wo {wo.shape}, "
                         f"residual {residual.shape} {residual.dtype}, layer {layer}")


def _check_scales(weights: tuple, scales: tuple, hadamard: int) -> None:
    """int8 weights take a float32 scale a column each, [out] at the layer; all or none."""
    int8 = {w.dtype == jnp.int8 for w in weights}
    if int8 != {bool(scales)} or (scales and (
            len(scales) != len(weights)
            or any(s.shape != (w.shape[-1],) or s.dtype != jnp.float32
                   for s, w in zip(scales, weights)))):
        raise ValueError(f"int8 weights take float32 scales [out] for each, float weights "
                         f"none: got weights {[(w.shape, str(w.dtype)) for w in weights]}, "
                         f"scales {[(s.shape, str(s.dtype)) for s in scales]}")
    inner = weights[-1].shape[-2]
    if hadamard < 0 or hadamard & (hadamard - 1) or (hadamard and LANES % hadamard) or (
            hadamard and inner % hadamard):
        raise ValueError(f"hadamard must be 0 or a power of 2 dividing {LANES} and the MLP's "
                         f"width {inner}, got {hadamard}")


def mlp(x, w_gate, w_up, w_down, *, layer=None, x_norm: InputNorm | None = None,
        residual=None, out_dtype=None, scales: tuple = (), hadamard: int = 0,
        name: str = "mlp", interpret=False):
    """(residual +) SiLU(x' @ w_gate) * (x' @ w_up) @ w_down, x' x RMS-normed with `x_norm`
    where given; in `out_dtype` (default x's; float32 for a row-split down projection's
    partial sums, without the residual). With `layer`, the weights are stacks [layers, ...]
    read at that layer where they lie. Rounded where the two projection kernels round: the
    gate and up's product to x's dtype, then the down product to out_dtype before the add.
    int8 weights take `scales`, a float32 [out] for each (at the layer), and multiply their
    inputs quantized per token (W8A8, kernels.int8); with `hadamard`, the gated product is
    multiplied by hadamard(n) in each run of n columns before down (an int8 model's)."""
    check_mlp_shapes(x, w_gate, w_up, w_down, layer)
    _check_scales((w_gate, w_up, w_down), tuple(scales), hadamard)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if residual is not None and (residual.shape != x.shape or residual.dtype != out_dtype):
        raise ValueError(f"a residual {list(x.shape)} in {out_dtype}, got {residual.shape} "
                         f"{residual.dtype}")
    return _call(x, None, (w_gate, w_up, w_down), layer, x_norm, residual, out_dtype,
                 tuple(scales), hadamard, name, interpret)


def out_and_mlp(attn, wo, residual, w_gate, w_up, w_down, *, layer=None,
                x_norm: InputNorm | None = None, scales: tuple = (), hadamard: int = 0,
                x_tile_heads: int = 0, name: str = "out_and_mlp", interpret=False):
    """The layer after its attention in one kernel: x = residual + attn @ wo, then x + the
    MLP of x (`mlp`'s, normed with `x_norm`), in the residual's dtype; rounded as the output
    projection's kernel and `mlp`. int8: `scales` for wo, gate, up and down, as `mlp`'s. With
    `x_tile_heads`, the attention's heads of that many lanes come a lane tile each, [T, heads
    x 128] (kernels.head_tiles), and are packed in VMEM first."""
    _check_out_projection(attn, wo, residual, layer, x_tile_heads)
    check_mlp_shapes(residual, w_gate, w_up, w_down, layer)
    _check_scales((wo, w_gate, w_up, w_down), tuple(scales), hadamard)
    return _call(attn, wo, (w_gate, w_up, w_down), layer, x_norm, residual, residual.dtype,
                 tuple(scales), hadamard, name, interpret, x_tile_heads)


def _call(x, wo, stacks: tuple, layer, x_norm, residual, out_dtype, scales: tuple,
          hadamard: int, name: str, interpret, x_tile_heads: int = 0):
    if layer is None:
        stacks, wo = tuple(w[None] for w in stacks), None if wo is None else wo[None]
    (tokens, depth), (hidden, inner) = x.shape, stacks[0].shape[-2:]
    out_depth = 0 if wo is None else wo.shape[-2]
    weight_itemsize = stacks[0].dtype.itemsize
    if not mlp_kernel_applies(tokens, hidden, inner, weight_itemsize, out_depth):
        raise ValueError(f"the MLP kernel takes at least {MIN_TOKENS} tokens in "
                         f"{NORM_MIN_STEPS} steps and weights of whole lane tiles, "
                         f"{_WEIGHTS_BYTES >> 20} MiB in all: x {x.shape}, inner {inner}"
                         f"{f', an output projection of {out_depth}' if out_depth else ''}")
    if x_norm is not None and x_norm.weight.shape != (hidden,):
        raise ValueError(f"x's norm takes a weight [{hidden}], got {x_norm.weight.shape}")
    rows = mlp_rows(tokens)
    columns = lambda width: first_chunk_columns(width, ProjectionBlocks(rows, width))  # noqa: E731
    layout = _Layout(columns(inner), columns(hidden) if wo is not None else 0,
                     residual is not None, x_norm and x_norm.eps, bool(scales), hadamard,
                     x_tile_heads)
    # int8 scales: gate's and up's [2, inner]; wo's (where taken) and down's [1 or 2, hidden]
    scale_operands = [jnp.stack(scales[-3:-1]), jnp.stack(scales[:-3] + scales[-1:])
                      ] if scales else []
    block = lambda width: pl.BlockSpec((rows, width), lambda i, *_: (i, 0))  # noqa: E731
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    operands = [x] + ([] if wo is None else [in_hbm(wo)]) + list(map(in_hbm, stacks)) + (
        [] if residual is None else [residual]) + (
        [] if x_norm is None else [x_norm.weight.reshape(1, hidden)]) + scale_operands
    out_scratch = [] if wo is None else [
        pltpu.VMEM(wo.shape[1:], wo.dtype),
        pltpu.SemaphoreType.DMA((hidden // layout.out_chunk,)),
        pltpu.VMEM((rows, hidden), residual.dtype)]
    return pl.pallas_call(
        functools.partial(_kernel, layout=layout),
        name=name,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(tokens // rows,),
            in_specs=[block(depth)] + [hbm] * (3 + (wo is not None))
            + ([] if residual is None else [block(hidden)])
            + ([] if x_norm is None else [pl.BlockSpec((1, hidden), lambda i, *_: (0, 0))])
            + [pl.BlockSpec(s.shape, lambda i, *_: (0, 0)) for s in scale_operands],
            out_specs=block(hidden),
            scratch_shapes=[pltpu.VMEM((hidden, inner), stacks[0].dtype),
                            pltpu.VMEM((hidden, inner), stacks[1].dtype),
                            pltpu.VMEM((inner, hidden), stacks[2].dtype),
                            pltpu.VMEM((rows, inner), x.dtype),
                            pltpu.SemaphoreType.DMA((inner // layout.chunk, 3))] + out_scratch),
        # the residual stream in HBM, as the projections': XLA would keep it in VMEM across
        # layers and attention, moving it out and back every layer (8-17 MiB at 2048 tokens
        # in Qwen3-0.6B's program: docs/tpu_v6e.md)
        out_shape=pltpu.HBM((tokens, hidden), out_dtype),
        # the output takes the residual's buffer (after the layer index, the input, the
        # stacks): a block is read before it is written
        input_output_aliases={} if residual is None else {1 + 4 + (wo is not None): 0},
        # sequential: the first step copies in the weights every step reads
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=_VMEM_LIMIT_BYTES),
        cost_estimate=pl.CostEstimate(
            flops=2 * tokens * hidden * (3 * inner + out_depth),
            transcendentals=tokens * inner,
            bytes_accessed=mlp_bytes(tokens, hidden, inner, x.dtype.itemsize,
                                     out_dtype.itemsize, residual is not None, out_depth,
                                     weight_itemsize, tile_spread(x_tile_heads, out_depth))),
        interpret=interpret,
    )(jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), *operands)


def mlp_reference(x, w_gate, w_up, w_down, *, layer=None, x_norm: InputNorm | None = None,
                  residual=None, out_dtype=None, scales: tuple = (), hadamard: int = 0,
                  name: str = "mlp", interpret=False):
    """Plain JAX, the same contract: the two projections' references."""
    del name, interpret
    check_mlp_shapes(x, w_gate, w_up, w_down, layer)
    _check_scales((w_gate, w_up, w_down), tuple(scales), hadamard)
    act = gated_up_reference(x, w_gate, w_up, layer=layer, x_norm=x_norm,
                             scales=tuple(scales[:2]), hadamard=hadamard)
    return project_reference(act, (w_down,), layer=layer, out_dtype=out_dtype,
                             residual=residual, scales=tuple(scales[2:]))[0]


def out_and_mlp_reference(attn, wo, residual, w_gate, w_up, w_down, *, layer=None,
                          x_norm: InputNorm | None = None, scales: tuple = (),
                          hadamard: int = 0, x_tile_heads: int = 0, name: str = "out_and_mlp",
                          interpret=False):
    """Plain JAX, the same contract: the projections' references."""
    del name, interpret
    _check_out_projection(attn, wo, residual, layer, x_tile_heads)
    if x_tile_heads:
        attn = heads_from_tiles(attn, x_tile_heads)
    _check_scales((wo, w_gate, w_up, w_down), tuple(scales), hadamard)
    (x,) = project_reference(attn, (wo,), layer=layer, residual=residual,
                             scales=tuple(scales[:1]))
    return mlp_reference(x, w_gate, w_up, w_down, layer=layer, x_norm=x_norm, residual=x,
                         scales=tuple(scales[1:]), hadamard=hadamard)
