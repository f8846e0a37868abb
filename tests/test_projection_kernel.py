"""The projection kernels vs their plain-JAX references (the model's XLA dots), in TPU
interpret mode on CPU, their blocks against VMEM, and compiled for TPU v6e."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.backends import select_kernels
from kernels.projection_kernel import (
    ProjectionBlocks,
    gated_up,
    gated_up_reference,
    project,
    project_reference,
    projection_blocks,
    projection_bytes,
)
from model import decoder
from model.sharding import ShardPlan
from profiling.v6e.compile import SIZED_MODELS, STUDY_MODELS, compile_for_v6e, mosaic_kernels
from runtime.buckets import ShapeBuckets


def _arrays(dtype, seed, *shapes):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0] if len(s) == 2 else 1), dtype)
            for s in shapes]


def _f32(x):
    return np.asarray(x, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_references_are_the_models_xla_path(dtype):
    """The model's own projections and MLP (model.decoder, XLA's dots) give the references'
    bits: the products, the bias in float32, the gate rounded before its SiLU."""
    x, wq, wk, wv, bq, bk, bv, gate, up, down = _arrays(
        dtype, 0, (48, 64), (64, 96), (64, 32), (64, 32), (96,), (32,), (32,), (64, 80),
        (64, 80), (80, 64))
    lp = dict(wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv, w_gate=gate, w_up=up, w_down=down)
    xla = select_kernels("xla", sm_scale=1.0, max_q_len=48, sizes=None)
    model = decoder._layer_projections(xla, lp, {}, 0, decoder._layer_dot(lp, None, 0, False),
                                       False)
    got = model(x, (("wk", "bk"), ("wv", "bv")), "project_kv")
    for g, w in zip(got, project_reference(x, (wk, wv), (bk, bv))):
        np.testing.assert_array_equal(_f32(g), _f32(w))
    mlp = decoder._mlp(model, None, x, ShardPlan())
    want = project_reference(gated_up_reference(x, gate, up), (down,))[0]
    np.testing.assert_array_equal(_f32(mlp), _f32(want))


@pytest.mark.parametrize("dtype,blocks", [
    (jnp.float32, None), (jnp.float32, ProjectionBlocks(16, 128)),
    (jnp.bfloat16, ProjectionBlocks(32, 384)), (jnp.bfloat16, ProjectionBlocks(64, 256))])
def test_kernels_equal_the_references(dtype, blocks):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    x, wk, wv, bk, bv = _arrays(dtype, 1, (64, 256), (256, 768), (256, 768), (768,), (768,))
    interpret = pltpu.InterpretParams(detect_races=True)
    # a block's dot may sum in another order: float32 rounding, or a bfloat16 ulp after it
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=1e-2)
    got = project(x, (wk, wv), (bk, bv), blocks=blocks, interpret=interpret)
    for g, w in zip(got, project_reference(x, (wk, wv), (bk, bv))):
        assert g.shape == (64, 768) and g.dtype == dtype
        np.testing.assert_allclose(_f32(g), _f32(w), **tol)
    (wide,) = project(x, (wk,), out_dtype=jnp.float32, blocks=blocks, interpret=interpret)
    assert wide.dtype == jnp.float32
    (want,) = project_reference(x, (wk,), out_dtype=jnp.float32)
    np.testing.assert_allclose(_f32(wide), _f32(want), **tol)
    gated = gated_up(x, wk, wv, blocks=blocks, interpret=interpret)
    np.testing.assert_allclose(_f32(gated), _f32(gated_up_reference(x, wk, wv)), **tol)
    assert not interpret_pallas_call.races.races_found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(16, 128), ProjectionBlocks(32, 256)])
def test_stacked_weights_are_read_at_the_layer(dtype, blocks):
    """Weights [layers, in, out] and a traced layer index (as in the model's layer loop): the
    kernels read that layer's weights and no other, whether a step's block holds all the
    columns (copied in once) or the next block is copied in while a step computes."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    x, w, b = _arrays(dtype, 3, (32, 128), (3, 128, 256), (256,))
    interpret = pltpu.InterpretParams(detect_races=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=1e-2)
    run = jax.jit(lambda x, at: (project(x, (w,), (b,), layer=at, blocks=blocks,
                                         interpret=interpret)[0],
                                 gated_up(x, w, w[::-1], layer=at, blocks=blocks,
                                          interpret=interpret)))
    for layer in range(3):
        got, gated = run(x, jnp.int32(layer))
        np.testing.assert_allclose(_f32(got), _f32(project_reference(x, (w[layer],), (b,))[0]),
                                   **tol)
        np.testing.assert_allclose(_f32(gated), _f32(gated_up_reference(x, w[layer],
                                                                        w[2 - layer])), **tol)
    assert not interpret_pallas_call.races.races_found
    with pytest.raises(ValueError, match="layer None"):
        project(x, (w,), interpret=True)
    with pytest.raises(ValueError, match="layer 0"):
        project(x, (w[0],), layer=0, interpret=True)


def test_bad_shapes_are_refused():
    x, w, b = _arrays(jnp.float32, 2, (32, 64), (64, 256), (256,))
    call = functools.partial(project, interpret=True)
    with pytest.raises(ValueError, match=r"x \(32, 64, 1\)"):
        call(x[..., None], (w,))
    with pytest.raises(ValueError, match=r"weights \[\(64, 256\), \(64, 128\)\]"):
        call(x, (w, w[:, :128]))
    with pytest.raises(ValueError, match=r"x \(32, 32\), weights \[\(64, 256\)\]"):
        call(x[:, :32], (w,))
    with pytest.raises(ValueError, match=r"biases \[\(256,\)\]"):
        call(x, (w, w), (b,))
    with pytest.raises(ValueError, match=r"biases \[\(128,\)\]"):
        call(x, (w,), (b[:128],))
    with pytest.raises(ValueError, match="blocks ProjectionBlocks"):
        call(x, (w,), blocks=ProjectionBlocks(24, 128))
    with pytest.raises(ValueError, match=r"weights \[\(64, 256\), \(64, 128\)\]"):
        gated_up(x, w, w[:, :128], interpret=True)


def test_which_weights_and_buckets_the_kernel_takes():
    from kernels.projection_kernel import MIN_TOKENS, projection_kernel_applies
    qwen3 = decoder.projection_shapes(SIZED_MODELS["Qwen3-0.6B"]).values()
    shapes = [(depth, width) for depth, width, _, _ in qwen3]
    assert projection_kernel_applies(MIN_TOKENS, shapes)
    assert not projection_kernel_applies(MIN_TOKENS // 2, shapes)  # bound by the weights' DMA
    assert not projection_kernel_applies(2048, shapes + [(896, 448)])  # half a lane tile
    assert not projection_kernel_applies(2048, [(576, 1536)])  # SmolLM2's hidden size


def _buckets():
    return ShapeBuckets(8192, 1, 1, 1, 8192, 16).token_sizes()


@pytest.mark.parametrize("model", STUDY_MODELS)
def test_blocks_fit_vmem_and_read_each_operand_once_where_it_fits(model):
    """Every layer's projection at every bucket up to 8,192 tokens: the blocks divide the
    operands, fit the kernel's VMEM limit double-buffered with their float32 products, and
    the weights (or, where they do not fit, the tokens) are read from HBM once."""
    from kernels import projection_kernel as pk
    for tokens in _buckets():
        for name, (depth, width, weights, outputs) in decoder.projection_shapes(
                STUDY_MODELS[model]).items():
            blocks = projection_blocks(tokens, depth, width, weights, 2)
            assert tokens % blocks.rows == 0 and width % blocks.columns == 0
            step = (blocks.rows * depth + weights * depth * blocks.columns
                    + outputs * blocks.rows * blocks.columns) * 2
            products = 4 * weights * blocks.rows * blocks.columns
            assert 2 * step + products <= pk._VMEM_LIMIT_BYTES, (tokens, name, blocks)
            moved = projection_bytes(tokens, depth, width, weights, outputs, 2, 2, blocks)
            least = 2 * (tokens * depth + weights * depth * width + outputs * tokens * width)
            if (tokens * depth * 2 <= pk._TOKENS_WHOLE_BYTES
                    or weights * depth * width * 2 <= pk._WEIGHTS_WHOLE_BYTES):
                assert moved == least, (tokens, name, blocks)


@pytest.mark.parametrize("model", SIZED_MODELS)
def test_a_layers_projections_compile_for_v6e(model):
    """Each projection of the sized models' layers at 2,048 tokens in bfloat16 (the gate and
    up as one), through Mosaic's compiler."""
    shapes = decoder.projection_shapes(SIZED_MODELS[model])
    sds, tokens = jax.ShapeDtypeStruct, 2048

    def layer(*args):
        args, outs = iter(args), []
        for name, (_, _, n, _) in shapes.items():
            x, weights = next(args), [next(args) for _ in range(n)]
            outs += ([gated_up(x, *weights, name=name)] if name == "gate_up"
                     else list(project(x, weights, name=name)))
        return outs
    args = [a for depth, width, n, _ in shapes.values()
            for a in [sds((tokens, depth), jnp.bfloat16)] + [sds((depth, width), jnp.bfloat16)] * n]
    compiled = compile_for_v6e(layer, *args)
    assert sorted(mosaic_kernels(compiled)) == sorted(shapes)


def q_projection(tokens: int):
    """Qwen3-0.6B's q projection over `tokens`, for compile_schedules."""
    depth, width, _, _ = decoder.projection_shapes(SIZED_MODELS["Qwen3-0.6B"])["project_q"]
    return (functools.partial(project, name="project_q"),
            (jax.ShapeDtypeStruct((tokens, depth), jnp.bfloat16),
             (jax.ShapeDtypeStruct((depth, width), jnp.bfloat16),)))


def test_the_estimate_prices_a_projection_at_its_steps_within_its_bounds():
    """Compiled for v6e, a projection is estimated at its grid steps, each the larger of its
    bundles and its share of the bytes the kernel moves: not below the MXU's or HBM's bound
    for its work, and within 1.5x of the larger (the schedule holds 1.1-1.2x)."""
    from profiling.v6e.kernel_estimates import projection_estimate
    from profiling.v6e.roofline import V6E_FLOPS
    from profiling.v6e.schedule import V6E_HBM_BYTES_PER_S, compile_schedules
    depth, width, _, _ = decoder.projection_shapes(SIZED_MODELS["Qwen3-0.6B"])["project_q"]
    for tokens, result in zip((512, 2048), compile_schedules(
            "tests.test_projection_kernel:q_projection", [dict(tokens=512), dict(tokens=2048)])):
        est = projection_estimate(result["kernels"]["project_q"], tokens, depth, width, 1, 1, 2)
        blocks = projection_blocks(tokens, depth, width, 1, 2)
        assert est["steps"] == blocks.steps(tokens, width) >= 4
        bound = max(2 * tokens * depth * width / V6E_FLOPS,
                    projection_bytes(tokens, depth, width, 1, 1, 2, 2, blocks)
                    / V6E_HBM_BYTES_PER_S)
        assert bound <= est["v6e_estimate_s"] <= 1.5 * bound, (tokens, est)
