"""The Pallas KV page-write kernel vs the XLA scatter, in TPU interpret mode on CPU, and
compiled for TPU v6e."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.kv_write_kernel import write_kv_pages_kernel
from kernels.ragged_paged_attention import write_kv_pages
from model.decoder import pool_head_dim
from profiling.v6e.compile import (
    SIZED_MODELS,
    compile_for_v6e,
    hbm_bytes,
    mosaic_kernels,
)

SHAPE = (2, 2, 12, 8, 64)  # layers, Hkv, pages, page size, head dim


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_writes_like_the_scatter(mode, dtype):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal(SHAPE), dtype) for _ in range(2))
    blocks = [jnp.asarray(rng.standard_normal((11, 2, 8, 64)), jnp.float32) for _ in range(2)]
    page_ids = jnp.asarray(list(rng.permutation(12)[:9]) + [12, 12], jnp.int32)  # 2 padding
    want = write_kv_pages(k, v, 1, *blocks, page_ids)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    got = write_kv_pages_kernel(k, v, 1, *blocks, page_ids, pages_per_step=4, interpret=params)
    assert not interpret_pallas_call.races.races_found
    for g, w, old in zip(got, want, (k, v)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        assert not np.array_equal(np.asarray(g[1], np.float32), np.asarray(old[1], np.float32))


def test_kernel_rejects_bad_shapes():
    pages = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="do not fit"):
        write_kv_pages_kernel(pages, pages, 0, jnp.zeros((4, 2, 4, 64)), jnp.zeros((4, 2, 4, 64)),
                              jnp.zeros(4, jnp.int32))


@pytest.mark.parametrize("model", SIZED_MODELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page", [16, 128])
def test_kernel_compiles_for_v6e_and_writes_in_place(model, dtype, page):
    """The whole grid through Mosaic's compiler (a second each): whole pages start on a tile
    boundary, and the donated pool is updated in place (no temp the size of the pool)."""
    cfg = SIZED_MODELS[model]
    sds = jax.ShapeDtypeStruct
    pages = sds((cfg.num_layers, cfg.num_kv_heads, 256, page, pool_head_dim(cfg, "pallas")),
                dtype)
    blocks = sds((40, *pages.shape[1:2], page, pages.shape[-1]), dtype)
    compiled = compile_for_v6e(write_kv_pages_kernel, pages, pages, sds((), jnp.int32), blocks,
                               blocks, sds((40,), jnp.int32), donate_argnums=(0, 1))
    assert mosaic_kernels(compiled) == ["write_kv_pages"]
    memory = hbm_bytes(compiled)
    assert memory["alias"] == 2 * pages.size * pages.dtype.itemsize
    assert memory["temp"] < memory["alias"] // 10
