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
    ACTIVATIONS,
    ProjectionBlocks,
    gated_up,
    gated_up_reference,
    project,
    project_reference,
    projection_blocks,
    projection_bytes,
)
from kernels.rms_norm import rms_norm
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
    bits: the products, the bias in float32, the gate rounded before its SiLU, the residual
    added to the rounded product."""
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
    mlp = decoder._mlp(ACTIVATIONS["silu"], model, None, x, ShardPlan(), residual=x)
    want = project_reference(gated_up_reference(x, gate, up), (down,), residual=x)[0]
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


@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(32, 128)])
def test_a_group_of_weights_is_read_as_its_weights(blocks):
    """Weights grouped in one stack [layers, n, in, out] (k's and v's: model.params.
    grouped_kv) give what the same weights in stacks of their own give, beside a stack of
    their shape in the same call; a group without a layer is refused."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    x, k, v, q, bk, bv, bq = _arrays(jnp.bfloat16, 6, (32, 128), (3, 128, 256), (3, 128, 256),
                                     (3, 128, 256), (256,), (256,), (256,))
    interpret = pltpu.InterpretParams(detect_races=True)
    group = jnp.stack([k, v], axis=1)
    run = jax.jit(lambda x, at, weights: project(x, weights, (bk, bv, bq), layer=at,
                                                 blocks=blocks, interpret=interpret))
    for layer in range(3):
        at = jnp.int32(layer)
        got, want = run(x, at, (group, q)), run(x, at, (k, v, q))
        reference = project_reference(x, (group, q), (bk, bv, bq), layer=layer)
        for g, w, r in zip(got, want, reference):
            np.testing.assert_array_equal(_f32(g), _f32(w))
            np.testing.assert_allclose(_f32(g), _f32(r), rtol=2 ** -7, atol=1e-2)
    assert not interpret_pallas_call.races.races_found
    with pytest.raises(ValueError, match=r"weights \[\(3, 2, 128, 256\)\].*layer None"):
        project(x, (group,), interpret=True)
    with pytest.raises(ValueError, match=r"biases \[\(256,\)\]"):
        project(x, (group,), (bk,), layer=0, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim, norm, blocks", [
    (128, True, None), (128, True, ProjectionBlocks(16, 256)), (64, False, None),
    (64, False, ProjectionBlocks(32, 128)), (256, True, ProjectionBlocks(16, 256))])
def test_rope_in_the_projection_is_the_norm_and_rope_kernels(dtype, head_dim, norm, blocks):
    """q's or k's norm and RoPE as the projection's epilogue (the first of k and v; stacked
    weights at a traced layer, a bias): the reference is the projection's then the norm and
    RoPE kernel's reference, bit for bit; the kernel, with race detection, is within the
    projection's tolerance of it and of the two kernels one after the other (the same ops on
    the same rounded product: an ulp apart where XLA fuses the interpreter's ops
    differently)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.rope_kernel import HeadRope, qk_norm_rope, qk_norm_rope_reference, \
        rope_lane_tables
    x, wk, wv, bk, bv, weight = _arrays(dtype, 4, (64, 256), (2, 256, 512), (2, 256, 512),
                                        (512,), (512,), (head_dim,))
    cos, sin = rope_lane_tables(jnp.arange(64) * 7, head_dim, 1e6)
    norms = (1 + weight / 4,) * 2 if norm else ()
    rope = HeadRope(cos, sin, norms[0] if norm else None, head_dim, 1e-6)
    interpret = pltpu.InterpretParams(detect_races=True)
    run = jax.jit(lambda x, at: project(x, (wk, wv), (bk, bv), layer=at, rope=rope,
                                        blocks=blocks, interpret=interpret))
    got = run(x, jnp.int32(1))
    want = project_reference(x, (wk, wv), (bk, bv), layer=1, rope=rope)
    k, v = project_reference(x, (wk, wv), (bk, bv), layer=1)
    twice = qk_norm_rope_reference(k, k, cos, sin, *norms, head_dim=head_dim, eps=1e-6)
    np.testing.assert_array_equal(_f32(want[0]), _f32(twice[0]))
    np.testing.assert_array_equal(_f32(want[1]), _f32(v))
    k, v = project(x, (wk, wv), (bk, bv), layer=1, blocks=blocks, interpret=interpret)
    two_kernels = qk_norm_rope(k, k, cos, sin, *norms, head_dim=head_dim, eps=1e-6,
                               interpret=interpret)[0]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2e-2)
    np.testing.assert_allclose(_f32(got[0]), _f32(two_kernels), **tol)
    np.testing.assert_array_equal(_f32(got[1]), _f32(v))
    for g, w in zip(got, want):
        np.testing.assert_allclose(_f32(g), _f32(w), **tol)
    assert not interpret_pallas_call.races.races_found


def test_a_step_of_many_rows_is_computed_in_sub_blocks():
    """A step of 1,536 rows is computed in three sub-blocks of 512 (so that one's epilogue
    overlaps the next one's products): the same as steps of 512 rows, for q's norm and RoPE,
    k's and v's group with biases, and gate and up; within tolerance of the references."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.rope_kernel import HeadRope, rope_lane_tables
    x, kv, b, weight = _arrays(jnp.bfloat16, 8, (1536, 128), (2, 2, 128, 256), (256,),
                               (128,))
    cos, sin = rope_lane_tables(jnp.arange(1536) * 3, 128, 1e6)
    rope = HeadRope(cos, sin, 1 + weight / 4, 128, 1e-6)
    interpret = pltpu.InterpretParams(detect_races=True)

    def both(rows):
        blocks = ProjectionBlocks(rows, 128)
        return (project(x, (kv,), (b, b), layer=1, rope=rope, blocks=blocks,
                        interpret=interpret)
                + (gated_up(x, kv[:, 0], kv[:, 1], layer=0, blocks=blocks,
                            interpret=interpret),))

    want = (project_reference(x, (kv,), (b, b), layer=1, rope=rope)
            + (gated_up_reference(x, kv[:, 0], kv[:, 1], layer=0),))
    for g, s, w in zip(both(1536), both(512), want):
        np.testing.assert_array_equal(_f32(g), _f32(s))
        np.testing.assert_allclose(_f32(g), _f32(w), rtol=2 ** -7, atol=2e-2)
    assert not interpret_pallas_call.races.races_found


def test_the_first_steps_weights_arrive_in_chunks():
    """Where a step holds every column, the first step waits for each chunk of 256 columns of
    the weights just before its products (race detection), in its own body where there are
    more steps, or in the one step's: q's norm and RoPE, k's and v's group with biases, into
    pages too, give the bits of steps of 256 columns; with those, the residual add, x's norm,
    and gate and up are within tolerance of the references, in four steps and in one."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.projection_kernel import InputNorm, PageWrite, first_chunk_columns
    from kernels.rope_kernel import HeadRope, rope_lane_tables
    x, kv, b, weight, r, pool = _arrays(jnp.bfloat16, 13, (64, 256), (2, 2, 256, 768),
                                        (768,), (128,), (64, 768), (2, 6, 5, 16, 128))
    cos, sin = rope_lane_tables(jnp.arange(64) * 3, 128, 1e6)
    rope, norm = HeadRope(cos, sin, 1 + weight / 4, 128, 1e-6), InputNorm(1 + b[:256], 1e-6)
    pages = PageWrite(pool, pool, jnp.asarray([3, 0, 2, 1], jnp.int32))
    interpret = pltpu.InterpretParams(detect_races=True)
    whole = ProjectionBlocks(16, 768)
    assert first_chunk_columns(768, whole) == 256 < whole.columns

    def rotated(fn, blocks):
        kw = dict(blocks=blocks, interpret=interpret)
        return (fn(x, (kv,), (b, b), layer=1, rope=rope, **kw)
                + fn(x, (kv,), (b, b), layer=0, rope=rope, pages=pages, **kw))

    def normed(up, gated, blocks):
        kw = dict(blocks=blocks, interpret=interpret)
        return (up(x, (kv[:, 0],), layer=1, residual=r, x_norm=norm, **kw)
                + (gated(x, kv[:, 0], kv[:, 1], layer=0, x_norm=norm, **kw),))

    got = rotated(project, whole)
    for g, c in zip(got, rotated(project, ProjectionBlocks(16, 256))):
        np.testing.assert_array_equal(_f32(g), _f32(c))
    got += normed(project, gated_up, whole)
    single = ProjectionBlocks(64, 768)  # one step: its one body waits
    assert first_chunk_columns(768, single) == 256
    want = (rotated(project_reference, None)
            + normed(project_reference, gated_up_reference, None))
    for g, s, w in zip(got, rotated(project, single) + normed(project, gated_up, single),
                       want):
        np.testing.assert_allclose(_f32(g), _f32(w), rtol=2 ** -7, atol=3e-2)
        np.testing.assert_allclose(_f32(s), _f32(w), rtol=2 ** -7, atol=3e-2)
    assert not interpret_pallas_call.races.races_found


@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(16, 128),
                                    ProjectionBlocks(32, 256), ProjectionBlocks(64, 128)])
@pytest.mark.parametrize("block_pages", [[5, 2, 7, 8], [3, 4, 5, 6], [2, 3, 4, 8]])
def test_k_and_v_go_into_their_pages(blocks, block_pages):
    """With pages, k's and v's products (k normed and rotated, biases, their weights one
    group read at a traced layer) go into the page of their block of rows, each step's copies
    in flight while the next steps compute (race detection): each page as the reference
    writes it, and every other page and layer as it was; a padding block's page (the pool's
    last) takes it and nothing else does. A step's pages that follow each other go in one
    copy for k and one for v, the others a page at a time (pages shuffled, consecutive, and
    both in one batch)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.projection_kernel import PageWrite
    from kernels.rope_kernel import HeadRope, rope_lane_tables
    x, kv, b, weight, k_pool, v_pool = _arrays(
        jnp.bfloat16, 9, (64, 256), (3, 2, 256, 256), (256,), (128,), (3, 2, 9, 16, 128),
        (3, 2, 9, 16, 128))
    cos, sin = rope_lane_tables(jnp.arange(64) * 5, 128, 1e6)
    rope = HeadRope(cos, sin, 1 + weight / 4, 128, 1e-6)
    pages = PageWrite(k_pool, v_pool, jnp.asarray(block_pages, jnp.int32))  # 8: padding
    interpret = pltpu.InterpretParams(detect_races=True)
    got = jax.jit(lambda x, at: project(x, (kv,), (b, b), layer=at, rope=rope, pages=pages,
                                        blocks=blocks, interpret=interpret))(x, jnp.int32(1))
    want = project_reference(x, (kv,), (b, b), layer=1, rope=rope, pages=pages)
    written = [p for p in block_pages if p != 8]
    for g, w, pool in zip(got, want, (k_pool, v_pool)):
        np.testing.assert_allclose(_f32(g[1, :, written]), _f32(w[1, :, written]),
                                   rtol=2 ** -7, atol=2e-2)
        kept = [p for p in range(8) if p not in written]
        np.testing.assert_array_equal(_f32(g[1, :, kept]), _f32(pool[1, :, kept]))
        for layer in (0, 2):
            np.testing.assert_array_equal(_f32(g[layer]), _f32(pool[layer]))
    assert not interpret_pallas_call.races.races_found
    with pytest.raises(ValueError, match=r"block_pages \[64 / page_size\], got \(3,\)"):
        project(x, (kv,), pages=PageWrite(k_pool, v_pool, jnp.zeros(3, jnp.int32)),
                layer=0, interpret=True)
    with pytest.raises(ValueError, match="whole pages and heads"):
        project(x, (kv,), pages=pages, layer=0, blocks=ProjectionBlocks(8, 128),
                interpret=True)


def test_a_steps_pages_in_one_copy_where_they_follow_each_other():
    """A step's pages go in one copy for k and one for v where they follow each other in the
    pool, a padding block's (the pool's last, repeated) breaking the run."""
    from kernels.projection_kernel import consecutive_steps
    pages = jnp.asarray([5, 2, 7, 8, 3, 4, 4, 4], jnp.int32)
    assert consecutive_steps(pages, 2).tolist() == [0, 1, 1, 0]
    assert consecutive_steps(pages, 4).tolist() == [0, 0]
    assert consecutive_steps(pages, 1).tolist() == [1] * 8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(16, 128), ProjectionBlocks(32, 256)])
def test_a_residual_is_added_to_the_product(dtype, blocks):
    """With a residual (the layer's residual stream), the product plus its bias is rounded,
    then added to it and rounded once: the bits of the kernel's own product added by XLA, as
    the model adds it; within tolerance of the reference. Anything but one output of the
    residual's shape and dtype is refused."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    x, w, b, r = _arrays(dtype, 11, (64, 256), (3, 256, 256), (256,), (64, 256))
    interpret = pltpu.InterpretParams(detect_races=True)
    run = jax.jit(lambda x, r, at: project(x, (w,), (b,), layer=at, residual=r,
                                           blocks=blocks, interpret=interpret)[0])
    got = run(x, r, jnp.int32(2))
    (plain,) = project(x, (w,), (b,), layer=2, blocks=blocks, interpret=True)
    np.testing.assert_array_equal(_f32(got), _f32(r + plain))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2e-2)
    np.testing.assert_allclose(_f32(got), _f32(project_reference(x, (w,), (b,), layer=2,
                                                                 residual=r)[0]), **tol)
    assert not interpret_pallas_call.races.races_found
    with pytest.raises(ValueError, match=r"a residual \[64, 256\].*got \(64, 128\)"):
        project(x, (w,), layer=0, residual=r[:, :128], interpret=True)
    with pytest.raises(ValueError, match="for 2 outputs"):
        project(x, (w, w), layer=0, residual=r, interpret=True)


@pytest.mark.parametrize("dtype, norm_dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                               (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(16, 256)])
def test_x_normed_in_the_kernel_is_the_models_norm(dtype, norm_dtype, blocks):
    """With x's norm (the layer's input RMSNorm; a float32 weight: Gemma's 1 + w), each block
    of x is normed in VMEM before the products, for a projection and for gate and up: within
    the projections' tolerance of the model's norm then the reference (the norm's sums run in
    another order); a step must hold every column, and the weights must fit VMEM whole for
    the blocks to give one."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.projection_kernel import InputNorm, norm_fits
    x, w, weight = _arrays(dtype, 12, (64, 256), (3, 256, 256), (256,))
    w, norm = w / 16, InputNorm((1 + weight / 4).astype(norm_dtype or dtype), 1e-6)
    interpret = pltpu.InterpretParams(detect_races=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2e-2)
    got = project(x, (w,), layer=1, x_norm=norm, blocks=blocks, interpret=interpret)[0]
    want = project_reference(rms_norm(x, norm.weight, 1e-6).astype(dtype), (w[1],))[0]
    np.testing.assert_allclose(_f32(got), _f32(want), **tol)
    np.testing.assert_allclose(_f32(got), _f32(project_reference(x, (w,), layer=1,
                                                                 x_norm=norm)[0]), **tol)
    gated = gated_up(x, w[0], w[2], x_norm=norm, blocks=blocks, interpret=interpret)
    np.testing.assert_allclose(_f32(gated), _f32(gated_up_reference(x, w[0], w[2],
                                                                    x_norm=norm)), **tol)
    assert not interpret_pallas_call.races.races_found
    with pytest.raises(ValueError, match=r"steps of all 256 columns"):
        project(x, (w,), layer=1, x_norm=norm, blocks=ProjectionBlocks(16, 128),
                interpret=True)
    with pytest.raises(ValueError, match=r"a weight \[256\]"):
        project(x, (w,), layer=1, x_norm=InputNorm(weight[:128], 1e-6), interpret=True)
    assert norm_fits(2048, 1024, 3072, 2, 2) and not norm_fits(2048, 2048, 8192, 2, 2)
    assert not norm_fits(1024, 1024, 3072, 2, 2)  # two steps: the weights' copy not spread
    assert norm_fits(2048, 2048, 8192, 2, 1)  # int8 in blocks of columns: normed as quantized


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_narrow_heads_go_each_into_a_lane_tile(dtype, head_dim):
    """With tile_heads, q's heads (RoPE'd) and k's and v's (into pages) come out each in a
    lane tile of its own, zeros after it: the reference's products padded head by head, the
    pool's untouched pages and layers as they were, with race detection; with x_tile_heads,
    the output projection takes the attention's heads so, whatever lies after them; a
    residual, RoPE of another head dim, or a head dim that does not divide 128 are refused."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.head_tiles import heads_in_tiles
    from kernels.projection_kernel import InputNorm, PageWrite
    from kernels.rope_kernel import HeadRope, rope_lane_tables
    heads = 256 // head_dim
    x, wq, kv, b, k_pool, v_pool = _arrays(dtype, 3, (64, 256), (2, 256, 512),
                                           (2, 2, 256, 256), (256,), (2, heads, 9, 16, 128),
                                           (2, heads, 9, 16, 128))
    rope = HeadRope(*rope_lane_tables(jnp.arange(64) * 5, head_dim, 1e6), None, head_dim, 1e-6)
    interpret = pltpu.InterpretParams(detect_races=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2e-2)
    (q,) = project(x, (wq,), layer=jnp.int32(1), rope=rope, tile_heads=head_dim,
                   interpret=interpret)
    (want,) = project_reference(x, (wq,), layer=1, rope=rope)
    assert q.shape == (64, 512 // head_dim * 128)
    tiles = _f32(q).reshape(64, -1, 128)
    np.testing.assert_allclose(tiles[..., :head_dim], _f32(want).reshape(64, -1, head_dim),
                               **tol)
    assert not tiles[..., head_dim:].any()
    pages = PageWrite(k_pool, v_pool, jnp.asarray([3, 0, 1, 8], jnp.int32))
    got = project(x, (kv,), (b, b), layer=jnp.int32(1), rope=rope, pages=pages,
                  tile_heads=head_dim, interpret=interpret)
    want = project_reference(x, (kv,), (b, b), layer=1, rope=rope, pages=pages,
                             tile_heads=head_dim)
    for g, w, pool in zip(got, want, (k_pool, v_pool)):
        np.testing.assert_allclose(_f32(g[1, :, [3, 0, 1]]), _f32(w[1, :, [3, 0, 1]]), **tol)
        assert not _f32(g[1, :, [3, 0, 1], :, head_dim:]).any()
        np.testing.assert_array_equal(_f32(g[1, :, 2]), _f32(pool[1, :, 2]))
        np.testing.assert_array_equal(_f32(g[0]), _f32(pool[0]))
    assert not interpret_pallas_call.races.races_found
    tiled = (heads_in_tiles(x, head_dim) + 7 * (jnp.arange(256 // head_dim * 128) % 128
                                                >= head_dim)).astype(dtype)
    (residual,) = _arrays(dtype, 4, (64, 512))
    (out,) = project(tiled, (wq,), layer=jnp.int32(1), residual=residual,
                     x_tile_heads=head_dim, interpret=interpret)
    np.testing.assert_allclose(_f32(out), _f32(project_reference(
        x, (wq,), layer=1, residual=residual)[0]), **tol)  # after a head: not read
    for bad in (dict(residual=jnp.zeros((64, 512), dtype), tile_heads=head_dim),
                dict(rope=HeadRope(*rope_lane_tables(jnp.arange(64), 128, 1e6), None, 128,
                                   1e-6), tile_heads=head_dim),
                dict(tile_heads=96)):
        with pytest.raises(ValueError, match="a lane tile each"):
            project(x, (wq,), layer=1, interpret=True, **bad)
    with pytest.raises(ValueError, match="a lane tile each take x"):
        project(tiled, (wq,), layer=1, x_norm=InputNorm(jnp.ones(256, dtype), 1e-6),
                x_tile_heads=head_dim, interpret=True)


def test_bad_rope_operands_are_refused():
    from kernels.rope_kernel import HeadRope, rope_lane_tables
    x, w, weight = _arrays(jnp.float32, 5, (32, 64), (64, 256), (128,))
    cos, sin = rope_lane_tables(jnp.arange(32), 128, 1e4)
    call = functools.partial(project, x, (w,), interpret=True)
    with pytest.raises(ValueError, match=r"cos \(16, 128\)"):
        call(rope=HeadRope(cos[:16], sin, None, 128, 1e-6))
    with pytest.raises(ValueError, match=r"norm \(64,\)"):
        call(rope=HeadRope(cos, sin, weight[:64], 128, 1e-6))
    with pytest.raises(ValueError, match="whole groups of 128 lanes"):
        project(x, (w[:, :192],), rope=HeadRope(cos, sin, None, 64, 1e-6), interpret=True)
    with pytest.raises(ValueError, match="column blocks of whole lane groups"):
        call(rope=HeadRope(*rope_lane_tables(jnp.arange(32), 256, 1e4), None, 256, 1e-6),
             blocks=ProjectionBlocks(32, 128))
    with pytest.raises(ValueError, match="need the projection kernel"):
        lp = dict(wq=w)
        xla = select_kernels("xla", sm_scale=1.0, max_q_len=32, sizes=None)
        decoder._layer_projections(xla, lp, {}, 0, decoder._layer_dot(lp, None, 0, False),
                                   False)(x, (("wq", "bq"),), "project_q",
                                          rope=HeadRope(cos, sin, None, 128, 1e-6))


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
    operands, fit the kernel's VMEM limit double-buffered with their float32 products (q's,
    k's and v's outputs, and the output projection's x, twice as wide with heads of 64, each
    in a lane tile), and the weights (or, where they do not fit, the tokens) are read from
    HBM once."""
    from kernels import projection_kernel as pk
    cfg = STUDY_MODELS[model]
    for tokens in _buckets():
        for name, (depth, width, weights, outputs) in decoder.projection_shapes(cfg).items():
            tiles = 128 // cfg.head_dim if cfg.head_dim < 128 else 1
            spread = tiles if name in decoder.ROTATED_PROJECTIONS else 1
            x_spread = tiles if name == "project_out" else 1
            blocks = projection_blocks(tokens, depth, width, weights, 2)
            assert tokens % blocks.rows == 0 and width % blocks.columns == 0
            step = (blocks.rows * depth * x_spread + weights * depth * blocks.columns
                    + outputs * blocks.rows * blocks.columns * spread) * 2
            products = 4 * weights * blocks.rows * blocks.columns
            assert 2 * step + products <= pk._VMEM_LIMIT_BYTES, (tokens, name, blocks)
            moved = projection_bytes(tokens, depth, width, weights, outputs, 2, 2, blocks,
                                     spread=spread, x_spread=x_spread)
            least = 2 * (tokens * depth * x_spread + weights * depth * width
                         + outputs * tokens * width * spread)
            if (tokens * depth * 2 <= pk._TOKENS_WHOLE_BYTES
                    or weights * depth * width * 2 <= pk._WEIGHTS_WHOLE_BYTES):
                assert moved == least, (tokens, name, blocks)


def test_deep_contractions_take_weight_blocks_of_the_mxus_width():
    """Qwen3-4B's and Qwen3-8B's down projections (9,728 and 12,288 deep, x and the weights
    both streamed in bfloat16): blocks of 256 columns, though their weights then pass
    _BLOCK_WEIGHT_BYTES (128 columns run v6e's MXU at half rate: 263 us a call against 182 at
    2,048 tokens, by the estimate); int8 weights reach 256 columns within it."""
    from kernels import projection_kernel as pk
    for model in ("Qwen3-4B", "Qwen3-8B"):
        depth, width, weights, _ = decoder.projection_shapes(STUDY_MODELS[model])["project_down"]
        for itemsize in (2, 1):
            blocks = projection_blocks(2048, depth, width, weights, 2, itemsize)
            assert blocks.columns == pk._MIN_COLUMNS, (model, itemsize, blocks)
            assert (depth * blocks.columns * itemsize > pk._BLOCK_WEIGHT_BYTES) == (
                itemsize == 2)


@pytest.mark.parametrize("model", SIZED_MODELS)
def test_a_layers_projections_compile_for_v6e(model):
    """Each projection of the sized models' layers at 2,048 tokens in bfloat16 (the gate and
    up as one; q's and k's norm and RoPE in theirs where the model takes the kernels: not
    SmolLM2-135M's heads), through Mosaic's compiler."""
    from kernels.projection_kernel import projection_kernel_applies
    from kernels.rope_kernel import HeadRope, lane_group
    cfg = SIZED_MODELS[model]
    shapes = decoder.projection_shapes(cfg)
    sds, tokens = jax.ShapeDtypeStruct, 2048
    norm = cfg.qk_norm or None
    rotating = (decoder.ROTATED_PROJECTIONS if projection_kernel_applies(
        tokens, [(depth, width) for depth, width, _, _ in shapes.values()]) else ())

    def layer(cos, sin, weight, *args):
        args, outs = iter(args), []
        rope = HeadRope(cos, sin, norm and weight, cfg.head_dim, cfg.rms_norm_eps)
        for name, (_, _, n, _) in shapes.items():
            x, weights = next(args), [next(args) for _ in range(n)]
            outs += ([gated_up(x, *weights, name=name)] if name == "gate_up"
                     else list(project(x, weights, name=name,
                                       rope=rope if name in rotating else None)))
        return outs
    tables = [sds((tokens, lane_group(cfg.head_dim)), jnp.float32)] * 2
    args = [a for depth, width, n, _ in shapes.values()
            for a in [sds((tokens, depth), jnp.bfloat16)] + [sds((depth, width), jnp.bfloat16)] * n]
    compiled = compile_for_v6e(layer, *tables, sds((cfg.head_dim,), jnp.bfloat16), *args)
    assert sorted(mosaic_kernels(compiled)) == sorted(shapes)


@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(16, 128), ProjectionBlocks(32, 256)])
def test_int8_weights_multiply_x_quantized_per_token(blocks):
    """int8 weights (a stack, and k's and v's group) with their scales at the layer: x
    quantized per token in VMEM (after its norm, where the kernel norms it; before the call
    where a step holds a block of the columns), int8 times int8
    into int32, dequantized before the bias and the residual add, SiLU times up: the
    references' bits (kernels.int8's XLA product; the SiLU within float32 rounding); float
    weights with scales, or int8 weights without, are refused."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from kernels.int8 import quantize_weight
    from kernels.projection_kernel import InputNorm
    x, w, b, norm = _arrays(jnp.bfloat16, 8, (32, 128), (3, 2, 128, 256), (256,), (128,))
    pairs = [[quantize_weight(w[layer, i], axis=0) for i in range(2)] for layer in range(3)]
    w8 = jnp.asarray(np.array([[v for v, _ in layer] for layer in pairs]))  # [3, 2, 128, 256]
    scales = jnp.asarray(np.array([[s for _, s in layer] for layer in pairs]))  # [3, 2, 256]
    interpret = pltpu.InterpretParams(detect_races=True)
    # in float32: XLA may skip rounding a bfloat16 norm before the reference's quantization
    x32, x_norm = x.astype(jnp.float32), InputNorm(norm.astype(jnp.float32), 1e-6)
    for layer in range(3):
        at, s = jnp.int32(layer), tuple(scales[layer])
        got = project(x, (w8,), (b, b), layer=at, scales=s, blocks=blocks, interpret=interpret)
        want = project_reference(x, (w8,), (b, b), layer=layer, scales=s)
        for g, r in zip(got, want):
            np.testing.assert_array_equal(_f32(g), _f32(r))
        (got,) = project(x[:, :128], (w8[:, 0, :, :128],), layer=at, scales=(s[0][:128],),
                         residual=x, blocks=blocks and ProjectionBlocks(blocks.rows, 128),
                         interpret=interpret)
        np.testing.assert_array_equal(_f32(got), _f32(project_reference(
            x[:, :128], (w8[:, 0, :, :128],), layer=layer, scales=(s[0][:128],),
            residual=x)[0]))
        gated = gated_up(x32, w8[:, 0], w8[:, 1], layer=at, scales=s, x_norm=x_norm,
                         blocks=blocks, interpret=interpret)  # normed as quantized, before
        np.testing.assert_allclose(gated, gated_up_reference(  # the SiLU's float32 rounding
            x32, w8[:, 0], w8[:, 1], layer=layer, scales=s, x_norm=x_norm), rtol=2e-5,
            atol=1e-5)
    assert not interpret_pallas_call.races.races_found
    with pytest.raises(ValueError, match="int8 weights' float32 scales"):
        project(x, (w8[0, 0],), interpret=True)
    with pytest.raises(ValueError, match=r"of \['bfloat16'\], .* scales \[\(256,\)\]"):
        project(x, (w[0, 0],), scales=(scales[0, 0],), interpret=True)


def q_projection(tokens: int):
    """Qwen3-0.6B's q projection over `tokens`, for compile_schedules."""
    depth, width, _, _ = decoder.projection_shapes(SIZED_MODELS["Qwen3-0.6B"])["project_q"]
    return (functools.partial(project, name="project_q"),
            (jax.ShapeDtypeStruct((tokens, depth), jnp.bfloat16),
             (jax.ShapeDtypeStruct((depth, width), jnp.bfloat16),)))


def test_the_estimate_prices_a_projection_at_its_steps_within_its_bounds():
    """Compiled for v6e, a projection is estimated at its grid steps, each the larger of its
    bundles and its share of the bytes the kernel moves: not below the MXU's bound for its
    work or HBM's at the rate DMAs reach, and within 1.5x of the larger (the schedule holds
    1.1-1.2x)."""
    from profiling.v6e.chip import V6E
    from profiling.v6e.kernel_estimates import projection_estimate
    from profiling.v6e.roofline import V6E_FLOPS
    from profiling.v6e.schedule import compile_schedules
    depth, width, _, _ = decoder.projection_shapes(SIZED_MODELS["Qwen3-0.6B"])["project_q"]
    for tokens, result in zip((512, 2048), compile_schedules(
            "tests.test_projection_kernel:q_projection", [dict(tokens=512), dict(tokens=2048)])):
        est = projection_estimate(result["kernels"]["project_q"], tokens, depth, width, 1, 1, 2)
        blocks = projection_blocks(tokens, depth, width, 1, 2)
        assert est["steps"] == blocks.steps(tokens, width) >= 4
        bound = max(2 * tokens * depth * width / V6E_FLOPS,
                    projection_bytes(tokens, depth, width, 1, 1, 2, 2, blocks)
                    / V6E.hbm_bytes_per_s)
        assert bound <= est["v6e_estimate_s"] <= 1.5 * bound, (tokens, est)


def test_the_first_step_waits_for_its_weights_two_chunks_at_a_time():
    """After the first chunk alone (the products start after one), each wait takes two: six
    waits drain the MXU's pipeline where twelve did (gate and up at 3,072 columns), and the
    last products after a wait are one chunk's where the chunks are even."""
    from kernels.projection_kernel import first_step_waits
    assert [list(g) for g in first_step_waits(12)] == [
        [0], [1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11]]
    assert [list(g) for g in first_step_waits(4)] == [[0], [1, 2], [3]]
    assert [list(g) for g in first_step_waits(1)] == [[0]]
    assert sorted(c for g in first_step_waits(9) for c in g) == list(range(9))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gemmas_geglu_in_the_gate_and_up_kernel(dtype):
    """Gemma's GeGLU (tanh-approximated GELU of the gate, times up) in the gate and up
    kernel, the gate rounded first as the model's XLA ops: in the TPU interpreter as its
    reference, not SiLU's product; and through Mosaic's compiler for v6e."""
    x, gate, up = _arrays(dtype, 21, (64, 256), (256, 512), (256, 512))
    got = gated_up(x, gate, up, activation="gelu_tanh", interpret=pltpu.InterpretParams())
    want = gated_up_reference(x, gate, up, activation="gelu_tanh")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2e-2)
    np.testing.assert_allclose(_f32(got), _f32(want), **tol)
    g = _f32(jnp.dot(x, gate, preferred_element_type=jnp.float32).astype(dtype))
    u = _f32(jnp.dot(x, up, preferred_element_type=jnp.float32).astype(dtype))
    geglu = ACTIVATIONS["gelu_tanh"](g) * u
    np.testing.assert_allclose(_f32(want), geglu, rtol=2e-2, atol=2e-2)
    silu = _f32(gated_up_reference(x, gate, up))
    assert np.abs(silu - _f32(want)).max() > 0.05 * np.abs(_f32(want)).max()
    sds = jax.ShapeDtypeStruct
    compiled = compile_for_v6e(
        lambda x, g, u: gated_up(x, g, u, activation="gelu_tanh"), sds((512, 1024), dtype),
        sds((1024, 2048), dtype), sds((1024, 2048), dtype))
    assert mosaic_kernels(compiled) == ["gate_up"]


@pytest.mark.parametrize("blocks", [None, ProjectionBlocks(16, 256)])
def test_down_inputs_hadamard_blocks_in_the_gate_and_up_kernel(blocks):
    """An int8 model's gate and up (model.quantize): the product times hadamard(128)
    in each block of 128 columns, the +-1 matrix made in the kernel: the reference's bits in
    the interpreter, not the product without the blocks; compiled for v6e at Qwen3-0.6B's
    gate and up (the MXU's int8 dots and the blocks' bfloat16 ones); chunks the blocks do
    not divide are refused."""
    from kernels.int8 import quantize_weight
    x, w = _arrays(jnp.bfloat16, 9, (32, 128), (2, 128, 512))
    pairs = [quantize_weight(w[i], axis=0) for i in range(2)]
    (g8, gs), (u8, us) = ((jnp.asarray(v), jnp.asarray(s)) for v, s in pairs)
    got = gated_up(x, g8, u8, scales=(gs, us), hadamard=128, blocks=blocks,
                   interpret=pltpu.InterpretParams(detect_races=True))
    want = gated_up_reference(x, g8, u8, scales=(gs, us), hadamard=128)
    np.testing.assert_array_equal(_f32(got), _f32(want))
    plain = _f32(gated_up_reference(x, g8, u8, scales=(gs, us)))
    assert np.abs(_f32(want) - plain).max() > np.abs(plain).max()
    with pytest.raises(ValueError, match="Hadamard blocks of 128 columns must divide"):
        gated_up(x, g8[:, :64], u8[:, :64], scales=(gs[:64], us[:64]), hadamard=128,
                 interpret=True)
    cfg, sds = SIZED_MODELS["Qwen3-0.6B"], jax.ShapeDtypeStruct
    depth, width, _, _ = decoder.projection_shapes(cfg)["gate_up"]
    weight, scale = sds((depth, width), jnp.int8), sds((width,), jnp.float32)
    compiled = compile_for_v6e(
        lambda x, g, u, gs, us: gated_up(x, g, u, scales=(gs, us), hadamard=128),
        sds((2048, depth), jnp.bfloat16), weight, weight, scale, scale)
    assert mosaic_kernels(compiled) == ["gate_up"]
