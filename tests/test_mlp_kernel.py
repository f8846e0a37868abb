"""The MLP kernel (with and without the output projection before it) vs its plain-JAX
reference (the projection kernels' references, the model's XLA path), in TPU interpret mode on
CPU, and compiled for TPU v6e with its estimate against its bounds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.mlp_kernel import (
    mlp,
    mlp_bytes,
    mlp_kernel_applies,
    mlp_reference,
    out_and_mlp,
    out_and_mlp_reference,
)
from kernels.int8 import quantize_weight
from kernels.projection_kernel import InputNorm
from profiling.v6e.compile import SIZED_MODELS

TOKENS = 2048  # the fewest the kernel takes: four steps of 512 rows


def _arrays(dtype, seed, *shapes):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1), dtype)
            for s in shapes]


def _f32(x):
    return np.asarray(x, np.float32)


def _close(got, want, dtype):
    """float32: the first step's down product sums its chunks in another order; bfloat16:
    that order may round a sum to the neighbouring value."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(_f32(got), _f32(want), **tol)
    if dtype == jnp.bfloat16:  # most values exact
        assert np.mean(_f32(got) == _f32(want)) > 0.95


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_mlp_kernel_is_its_reference(dtype):
    """x's norm, the gated product, down and the residual add, the weights read from stacks at
    a layer; and without the residual, a row-split down's float32 partial sums."""
    hidden, inner, layers = 128, 512, 2
    x, gate, up, down, norm = _arrays(dtype, 0, (TOKENS, hidden), (layers, hidden, inner),
                                      (layers, hidden, inner), (layers, inner, hidden),
                                      (hidden,))
    x_norm, layer = InputNorm(1 + norm / 4, 1e-6), jnp.int32(1)
    run = dict(interpret=pltpu.InterpretParams())
    got = mlp(x, gate, up, down, layer=layer, x_norm=x_norm, residual=x, **run)
    want = mlp_reference(x, gate, up, down, layer=layer, x_norm=x_norm, residual=x)
    assert got.dtype == x.dtype and got.shape == x.shape
    _close(got, want, dtype)
    sums = mlp(x, gate[1], up[1], down[1], out_dtype=jnp.float32, **run)
    assert sums.dtype == jnp.float32
    _close(sums, mlp_reference(x, gate[1], up[1], down[1], out_dtype=jnp.float32),
           jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_output_projection_and_mlp_kernel_is_its_reference(dtype):
    """residual + attn @ wo, then its MLP and residual add, in one kernel."""
    depth, hidden, inner, layers = 256, 128, 384, 2
    attn, residual, wo, gate, up, down, norm = _arrays(
        dtype, 1, (TOKENS, depth), (TOKENS, hidden), (layers, depth, hidden),
        (layers, hidden, inner), (layers, hidden, inner), (layers, inner, hidden), (hidden,))
    x_norm, layer = InputNorm(1 + norm / 4, 1e-6), jnp.int32(0)
    got = out_and_mlp(attn, wo, residual, gate, up, down, layer=layer, x_norm=x_norm,
                      interpret=pltpu.InterpretParams())
    _close(got, out_and_mlp_reference(attn, wo, residual, gate, up, down, layer=layer,
                                      x_norm=x_norm), dtype)


@pytest.mark.parametrize("int8", [False, True])
def test_the_attentions_heads_in_lane_tiles_are_packed_first(int8):
    """Heads of 64 lanes a lane tile each (the attention's output where the pool pads them,
    kernels.head_tiles), something other than zeros after each: the same as the heads given
    packed, float32 and int8 in bfloat16 (bit for bit)."""
    from kernels.head_tiles import heads_in_tiles
    depth, hidden, inner, layers, head_dim = 256, 128, 384, 2, 64
    dtype = jnp.bfloat16 if int8 else jnp.float32
    attn, residual, wo, gate, up, down = _arrays(
        dtype, 6, (TOKENS, depth), (TOKENS, hidden), (layers, depth, hidden),
        (layers, hidden, inner), (layers, hidden, inner), (layers, inner, hidden))
    run = dict(layer=jnp.int32(1), x_norm=InputNorm(jnp.ones(hidden, dtype), 1e-6))
    if int8:
        (wo, gate, up, down), scales = _int8(wo, gate, up, down)
        run |= dict(scales=tuple(s[1] for s in scales), hadamard=64)
    after = 7 * (jnp.arange(depth // head_dim * 128) % 128 >= head_dim)
    tiled = heads_in_tiles(attn, head_dim) + after.astype(dtype)
    want = out_and_mlp_reference(attn, wo, residual, gate, up, down, **run)
    np.testing.assert_array_equal(
        _f32(out_and_mlp_reference(tiled, wo, residual, gate, up, down,
                                   x_tile_heads=head_dim, **run)), _f32(want))
    got = out_and_mlp(tiled, wo, residual, gate, up, down, x_tile_heads=head_dim,
                      interpret=pltpu.InterpretParams(), **run)
    if int8:
        np.testing.assert_array_equal(_f32(got), _f32(want))
    else:
        _close(got, want, dtype)
    with pytest.raises(ValueError, match=r"2 times wider with heads of 64"):
        out_and_mlp(attn, wo, residual, gate, up, down, x_tile_heads=head_dim, **run)


def _int8(*stacks):
    """Each stack [layers, in, out] as int8 values and their float32 scales [layers, out]."""
    pairs = [quantize_weight(np.asarray(w, np.float32), axis=-2) for w in stacks]
    return [jnp.asarray(v) for v, _ in pairs], [jnp.asarray(s) for _, s in pairs]


@pytest.mark.parametrize("with_out", [False, True])
def test_int8_weights_multiply_inputs_quantized_per_token_as_their_reference(with_out):
    """W8A8 in the kernel: the attention's output, x (after its norm) and the gated product
    after its Hadamard blocks quantized per token in VMEM, int8 products dequantized: the
    projection kernels' references' bits in bfloat16, and within float32 rounding after the
    norm, computed in float32 (XLA may skip rounding a bfloat16 norm before the reference's
    quantization, as in tests/test_projection_kernel.py); not the product without the
    Hadamard blocks."""
    depth, hidden, inner, layers = 256, 128, 512, 2
    (wo, gate, up, down), scales = _int8(*_arrays(
        jnp.float32, 4, (layers, depth, hidden), (layers, hidden, inner),
        (layers, hidden, inner), (layers, inner, hidden)))
    layer, interpret = 1, pltpu.InterpretParams(detect_races=True)
    at_layer = tuple(s[layer] for s in scales)

    def both(dtype, x_norm, hadamard=64):
        attn, residual = _arrays(dtype, 3, (TOKENS, depth), (TOKENS, hidden))
        run = dict(layer=jnp.int32(layer), x_norm=x_norm, hadamard=hadamard)
        if with_out:
            args = (attn, wo, residual, gate, up, down)
            return (out_and_mlp(*args, scales=at_layer, interpret=interpret, **run),
                    out_and_mlp_reference(*args, scales=at_layer, **run))
        args = (residual, gate, up, down)
        return (mlp(*args, residual=residual, scales=at_layer[1:], interpret=interpret, **run),
                mlp_reference(*args, residual=residual, scales=at_layer[1:], **run))

    got, want = both(jnp.bfloat16, None)
    assert got.dtype == jnp.bfloat16 and got.shape == (TOKENS, hidden)
    np.testing.assert_array_equal(_f32(got), _f32(want))
    assert np.mean(_f32(both(jnp.bfloat16, None, hadamard=0)[1]) != _f32(want)) > 0.5
    norm = _arrays(jnp.float32, 5, (hidden,))[0]
    _close(*both(jnp.float32, InputNorm(1 + norm / 4, 1e-6)), jnp.float32)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    assert not interpret_pallas_call.races.races_found


def test_bad_shapes_and_sizes_are_refused_with_their_shapes():
    x, gate, up, down = _arrays(jnp.float32, 2, (TOKENS, 128), (128, 256), (128, 256),
                                (256, 128))
    with pytest.raises(ValueError, match=r"down \(128, 256\)"):
        mlp(x, gate, up, down.T)
    with pytest.raises(ValueError, match="a residual"):
        mlp(x, gate, up, down, residual=x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"at least 512 tokens.*x \(1024, 128\)"):
        mlp(x[:1024], gate, up, down)  # two steps: too few to spread the weights' copy
    with pytest.raises(ValueError, match=r"wo \(128, 256\)"):
        out_and_mlp(x, gate, x, gate, up, down)  # wo's columns must be the residual's
    with pytest.raises(ValueError, match=r"a weight \[128\]"):
        mlp(x, gate, up, down, x_norm=InputNorm(jnp.ones(64), 1e-6))
    (gate8, up8, down8), (gs, us, ds) = _int8(gate[None], up[None], down[None])
    with pytest.raises(ValueError, match="int8 weights take float32 scales"):
        mlp(x, gate8[0], up8[0], down8[0], scales=(gs[0], us[0]))  # down's missing
    with pytest.raises(ValueError, match="int8 weights take float32 scales"):
        mlp(x, gate, up, down, scales=(gs[0], us[0], ds[0]))  # float weights
    with pytest.raises(ValueError, match="hadamard must be"):
        mlp(x, gate8[0], up8[0], down8[0], scales=(gs[0], us[0], ds[0]), hadamard=96)


def test_the_kernel_takes_the_mlps_whose_weights_fit_vmem():
    """Qwen3-0.6B's and Qwen2.5-0.5B's MLPs with their output projections from 2,048 tokens
    (not at 512: one step); Llama-3.2-1B's MLP, 96 MiB of weights, is left to the projection
    kernels in bfloat16 and taken in int8 (52 MiB with wo's), as is a width of part of a
    lane tile."""
    for name, itemsize, fits in (("Qwen3-0.6B", 2, True), ("Qwen2.5-0.5B", 2, True),
                                 ("Llama-3.2-1B", 2, False), ("Llama-3.2-1B", 1, True)):
        cfg = SIZED_MODELS[name]
        q_width = cfg.num_heads * cfg.head_dim
        for tokens in (512, 2048, 8192):
            assert mlp_kernel_applies(tokens, cfg.hidden_size, cfg.intermediate_size, itemsize,
                                      q_width) == (fits and tokens >= 2048), (name, tokens)
    assert not mlp_kernel_applies(2048, 576, 1536, 2)  # SmolLM2-135M's hidden size


HIDDEN, INNER, ATTENTION = 1024, 2048, 1024  # Qwen3-0.6B's hidden size, a narrower MLP


def _after_attention():
    """The layer after attention at TOKENS in bfloat16 (for compile_schedules): an MLP
    narrower than Qwen3-0.6B's, which compiles in half the time (its whole program at every
    bucket and TP compiles in tests/test_tpu_programs.py, in int8 too)."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731

    def after_attention(attn, wo, residual, norm, gate, up, down):
        return out_and_mlp(attn, wo, residual, gate, up, down, layer=jnp.int32(3),
                           x_norm=InputNorm(norm, 1e-6))
    return after_attention, (sds(TOKENS, ATTENTION), sds(28, ATTENTION, HIDDEN),
                             sds(TOKENS, HIDDEN), sds(HIDDEN), sds(28, HIDDEN, INNER),
                             sds(28, HIDDEN, INNER), sds(28, INNER, HIDDEN))


def test_the_estimate_prices_the_kernel_within_its_bounds():
    """Compiled for v6e with the output projection (the one chip's kernel; the MLP alone
    compiles in tests/test_tpu_programs.py at TP 4): estimated at no less than its MXU bound
    (its products at the bf16 peak) or its HBM bound (the bytes it moves, at the rate DMAs
    reach), and within 1.4x of the larger (its weights' one copy waits in the first of four
    steps; the others run at 1.05-1.15x the MXU's rate)."""
    from profiling.v6e.chip import V6E
    from profiling.v6e.kernel_estimates import mlp_estimate
    from profiling.v6e.roofline import V6E_FLOPS
    from profiling.v6e.schedule import compile_schedules
    (result,) = compile_schedules("tests.test_mlp_kernel:_after_attention", [{}])
    est = mlp_estimate(result["kernels"]["out_and_mlp"], TOKENS, HIDDEN, INNER, 2, True,
                       ATTENTION)
    assert est["steps"] == 4
    bound = max(2 * TOKENS * HIDDEN * (3 * INNER + ATTENTION) / V6E_FLOPS,
                mlp_bytes(TOKENS, HIDDEN, INNER, 2, 2, True, ATTENTION) / V6E.hbm_bytes_per_s)
    assert bound <= est["v6e_estimate_s"] <= 1.4 * bound, (est, bound)
