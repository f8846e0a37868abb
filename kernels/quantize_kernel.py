"""x quantized per token for an int8 projection (W8A8, kernels.int8), RMS-normed first where
a norm weight is given: one pass over x in blocks of rows, each read once and written once in
int8 with its scales, and its plain-JAX reference.

The projection kernel quantizes its block of x in VMEM where a step holds every column; where
its steps hold a block of the columns it takes x quantized by this kernel instead, once (XLA's
fusions of the same norm and quantization took 2.3x its bundles in the v6e schedule:
docs/tpu_v6e.md).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.int8 import quantize_tokens
from kernels.rms_norm import rms_norm
from kernels.tpu_tiles import row_block

_MAX_ROWS = 512
_BLOCK_BYTES = 4 << 20  # x's block and its int8 values, double-buffered, well inside VMEM
_INT8_ROWS = 32  # an int8 tile's rows


def quantized_rows(x, norm_weight=None, eps: float = 0.0, *, name: str = "quantize_x",
                   interpret=False) -> tuple[jax.Array, jax.Array]:
    """(int8 values [T, D], float32 scales [T, 1]) of x [T, D], a scale per token, after x's
    RMSNorm (kernels.rms_norm, in x's dtype) where `norm_weight` [D] is given."""
    tokens, depth = x.shape
    if norm_weight is not None and norm_weight.shape != (depth,):
        raise ValueError(f"x {x.shape}'s norm takes a weight [{depth}], got "
                         f"{norm_weight.shape}")
    rows = quantize_row_block(tokens, depth, x.dtype.itemsize)
    block = pl.BlockSpec((rows, depth), lambda i: (i, 0))
    norm = () if norm_weight is None else (norm_weight.reshape(1, depth),)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        name=name,
        grid=(tokens // rows,),
        in_specs=[block] + [pl.BlockSpec((1, depth), lambda i: (0, 0))] * len(norm),
        out_specs=[block, pl.BlockSpec((rows, 1), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, depth), jnp.int8),
                   jax.ShapeDtypeStruct((tokens, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=(6 if norm else 3) * tokens * depth, transcendentals=tokens,
            bytes_accessed=tokens * depth * (x.dtype.itemsize + 1) + tokens * 4),
        interpret=interpret,
    )(x, *norm)


def quantize_row_block(tokens: int, depth: int, itemsize: int) -> int:
    """Rows of x (of `itemsize`) a step."""
    return row_block(tokens, lambda r: r <= _MAX_ROWS
                     and r * depth * (itemsize + 1) <= _BLOCK_BYTES, least=_INT8_ROWS)


def _kernel(x_ref, *refs, eps: float):
    *norm_ref, values_ref, scales_ref = refs
    x = x_ref[...]
    if norm_ref:
        x = rms_norm(x, norm_ref[0][...], eps).astype(x.dtype)
    values_ref[...], scales_ref[...] = quantize_tokens(x, axis=1)


def quantized_rows_reference(x, norm_weight=None, eps: float = 0.0, **_):
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps).astype(x.dtype)
    return quantize_tokens(x, axis=1)
