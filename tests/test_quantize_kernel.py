"""x quantized per token (after its norm) for int8 projections, in TPU interpret mode on CPU
against its reference, and compiled for TPU v6e before a projection in blocks of columns."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.quantize_kernel import quantized_rows, quantized_rows_reference
from profiling.v6e.compile import compile_for_v6e, mosaic_kernels


@pytest.mark.parametrize("dtype, norm_dtype", [(jnp.bfloat16, None), (jnp.float32, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
def test_rows_quantize_as_the_reference_with_and_without_the_norm(dtype, norm_dtype):
    """x in blocks of rows, normed first where a weight is given: the reference's int8 values
    (their scales within a rounding after a norm: XLA's fused reference may divide by 127
    as a product); a row of zeros gets scale 1. A bfloat16 norm within one step (XLA may
    keep the reference's norm in float32 instead of rounding it to bfloat16)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 256)) * rng.uniform(0.1, 10, (1024, 1))
    x[5] = 0
    x = jnp.asarray(x, dtype)
    norm = () if norm_dtype is None else (
        jnp.asarray(rng.uniform(0.5, 2, 256), norm_dtype), 1e-6)
    values, scales = quantized_rows(x, *norm, interpret=pltpu.InterpretParams())
    want_values, want_scales = quantized_rows_reference(x, *norm)
    assert values.dtype == jnp.int8 and values.shape == x.shape and scales.shape == (1024, 1)
    assert scales[5, 0] == 1 and not np.any(values[5])
    assert np.abs(np.asarray(values, np.int32)).max() == 127
    if norm_dtype == jnp.bfloat16:
        off = np.abs(np.asarray(values, np.int32) - np.asarray(want_values, np.int32))
        assert off.max() <= 1 and off.mean() < 0.05
        np.testing.assert_allclose(scales, want_scales, rtol=2 ** -7)
        return
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_allclose(scales, want_scales, rtol=0 if norm_dtype is None else 1e-6)


def test_a_norm_weight_of_another_width_is_refused():
    with pytest.raises(ValueError, match=r"x \(64, 256\)'s norm takes a weight \[256\]"):
        quantized_rows(jnp.zeros((64, 256), jnp.bfloat16), jnp.ones(128), 1e-6,
                       interpret=True)


def test_an_int8_call_in_blocks_of_columns_compiles_for_v6e_after_its_quantization():
    """Llama-3.2-1B's gate and up at 2048 tokens in int8 (8 steps of 1024 columns), normed:
    x normed and quantized by its own kernel, then the projection kernel on int8 x and its
    scales, through Mosaic's compiler for v6e."""
    from kernels.projection_kernel import InputNorm, gated_up, projection_blocks
    assert not projection_blocks(2048, 2048, 8192, 2, 2, 1).all_columns(8192)
    sds = jax.ShapeDtypeStruct
    compiled = compile_for_v6e(
        lambda x, g, u, sg, su, w: gated_up(x, g, u, scales=(sg, su),
                                            x_norm=InputNorm(w, 1e-5)),
        sds((2048, 2048), jnp.bfloat16), sds((2048, 8192), jnp.int8),
        sds((2048, 8192), jnp.int8), sds((8192,), jnp.float32), sds((8192,), jnp.float32),
        sds((2048,), jnp.bfloat16))
    assert sorted(mosaic_kernels(compiled)) == ["gate_up", "quantize_gate_up"]
