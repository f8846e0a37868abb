"""q's and k's norm and RoPE kernel vs its plain-JAX reference (the model's XLA ops), in TPU
interpret mode on CPU, and compiled for TPU v6e."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.rms_norm import rms_norm
from kernels.rope_kernel import (
    qk_norm_rope,
    qk_norm_rope_reference,
    rope_kernel_applies,
    rope_lane_tables,
)
from model.decoder import apply_rope, rope_tables
from profiling.v6e.compile import SIZED_MODELS, compile_for_v6e, mosaic_kernels

EPS = 1e-6


def _case(tokens, q_heads, kv_heads, head_dim, norm, dtype, seed=0, norm_dtype=None):
    """`norm_dtype`: the norms' (float32: Gemma 3's 1 + w in a bfloat16 model); x's dtype."""
    rng = np.random.default_rng(seed)
    positions = jnp.asarray(rng.integers(0, 40_000, tokens), jnp.int32)
    q, k = (jnp.asarray(rng.standard_normal((tokens, h * head_dim)) * 3, dtype)
            for h in (q_heads, kv_heads))
    norms = tuple(jnp.asarray(rng.standard_normal(head_dim), norm_dtype or dtype)
                  for _ in range(2)) if norm else ()
    return positions, q, k, norms


def _f32(x):
    return np.asarray(x, np.float32)


@pytest.mark.parametrize("head_dim,norm", [(128, True), (128, False), (64, False),
                                           (256, False), (32, False)])
def test_reference_is_the_models_xla_path(head_dim, norm):
    positions, q, k, norms = _case(24, 4, 2, head_dim, norm, jnp.float32)
    cos, sin = rope_tables(positions, head_dim, 1e6)

    def model(x, weight):
        x = x.reshape(x.shape[0], -1, head_dim)
        if weight is not None:
            x = rms_norm(x, weight, EPS)
        return apply_rope(x, cos, sin).reshape(x.shape[0], -1)

    got = qk_norm_rope_reference(q, k, *rope_lane_tables(positions, head_dim, 1e6), *norms,
                                 head_dim=head_dim, eps=EPS)
    for g, x, w in zip(got, (q, k), norms or (None, None)):
        np.testing.assert_array_equal(_f32(g), _f32(model(x, w)))


@pytest.mark.parametrize("head_dim,norm,dtype,block,norm_dtype", [
    (128, True, jnp.float32, 16, None), (128, True, jnp.bfloat16, 32, None),
    (256, True, jnp.bfloat16, 16, jnp.float32), (64, False, jnp.float32, 8, None),
    (64, False, jnp.bfloat16, None, None), (256, False, jnp.float32, 16, None),
    (32, False, jnp.float32, 16, None)])
def test_kernel_equals_the_reference(head_dim, norm, dtype, block, norm_dtype):
    """Qwen3's norms, and Gemma 3's float32 ones on bfloat16 heads of 256 (the product in
    float32, rounded to bfloat16 before RoPE, as HF's)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    positions, q, k, norms = _case(64, 4, 2, head_dim, norm, dtype, norm_dtype=norm_dtype)
    tables = rope_lane_tables(positions, head_dim, 1e6)
    kw = dict(head_dim=head_dim, eps=EPS, block_tokens=block)
    want = qk_norm_rope_reference(q, k, *tables, *norms, **kw)
    got = qk_norm_rope(q, k, *tables, *norms, interpret=pltpu.InterpretParams(
        detect_races=True), **kw)
    assert not interpret_pallas_call.races.races_found
    # float32: rounding of the statistics; bfloat16: the normed value (bfloat16, as in the
    # model) an ulp off where its statistic rounds differently, an ulp of values up to ~8
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7,
                                                                          atol=2 ** -5)
    for g, w, x in zip(got, want, (q, k)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(_f32(g), _f32(w), **tol)
        assert not np.allclose(_f32(g), _f32(x))


def test_rotation_moves_each_lane_within_its_head():
    """One nonzero lane of one head: after RoPE only that lane and its partner half a head away
    are nonzero, in that head alone (a roll across heads would show up in a neighbour)."""
    head_dim, positions = 64, jnp.asarray([3] * 8, jnp.int32)
    q = jnp.zeros((8, 4 * head_dim)).at[:, head_dim + 5].set(1.0)
    k = jnp.zeros((8, 2 * head_dim)).at[:, head_dim + 40].set(1.0)
    gq, gk = qk_norm_rope(q, k, *rope_lane_tables(positions, head_dim, 1e4), head_dim=head_dim,
                          eps=EPS, interpret=pltpu.InterpretParams())
    assert set(np.flatnonzero(_f32(gq)[0])) == {head_dim + 5, head_dim + 5 + 32}
    assert set(np.flatnonzero(_f32(gk)[0])) == {head_dim + 40, head_dim + 40 - 32}


def test_bad_shapes_are_refused():
    positions, q, k, norms = _case(16, 2, 1, 128, True, jnp.float32)
    cos, sin = rope_lane_tables(positions, 128, 1e6)
    call = functools.partial(qk_norm_rope, head_dim=128, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"q \(16, 256\), k \(16, 64\)"):
        call(q, k[:, :64], cos, sin)
    with pytest.raises(ValueError, match=r"cos \(8, 128\)"):
        call(q, k, cos[:8], sin)
    with pytest.raises(ValueError, match="norm weights"):
        call(q, k, cos, sin, norms[0], None)
    with pytest.raises(ValueError, match="block_tokens 12"):
        call(q, k, cos, sin, block_tokens=12)
    with pytest.raises(ValueError, match="head_dim 96"):
        rope_lane_tables(positions, 96, 1e6)


def test_which_heads_the_kernel_takes():
    assert rope_kernel_applies(128, qk_norm=True) and rope_kernel_applies(64, qk_norm=False)
    assert rope_kernel_applies(256, qk_norm=True)
    assert not rope_kernel_applies(64, qk_norm=True)  # a norm sums whole lane tiles
    assert not rope_kernel_applies(96, qk_norm=False) and not rope_kernel_applies(80, False)


@pytest.mark.parametrize("model", SIZED_MODELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_compiles_for_v6e(model, dtype):
    """The sized models' heads through Mosaic's compiler, the norm where the family has one."""
    cfg = SIZED_MODELS[model]
    norm = cfg.qk_norm
    assert rope_kernel_applies(cfg.head_dim, norm)
    sds, tokens = jax.ShapeDtypeStruct, 512
    group = max(cfg.head_dim, 128)
    args = [sds((tokens, cfg.num_heads * cfg.head_dim), dtype),
            sds((tokens, cfg.num_kv_heads * cfg.head_dim), dtype),
            sds((tokens, group), jnp.float32), sds((tokens, group), jnp.float32)]
    args += [sds((cfg.head_dim,), dtype)] * 2 if norm else []
    compiled = compile_for_v6e(functools.partial(qk_norm_rope, head_dim=cfg.head_dim, eps=EPS),
                               *args)
    assert mosaic_kernels(compiled) == ["qk_norm_rope"]
