"""The Pallas KV page-write kernel vs the XLA scatter, in TPU interpret mode on CPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.kv_write_kernel import write_kv_pages_kernel
from kernels.ragged_paged_attention import write_kv_pages
from tests.tpu_lowering import tpu_export

SHAPE = (2, 2, 6, 8, 64)  # layers, Hkv, pages, page size, head dim


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_writes_like_the_scatter(mode, dtype):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal(SHAPE), dtype) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.standard_normal((13, 2, 64)), jnp.float32) for _ in range(2))
    slots = jnp.asarray(list(rng.permutation(48)[:11]) + [48, 48], jnp.int32)  # 2 padding
    want = write_kv_pages(k, v, 1, k_new, v_new, slots)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    got = write_kv_pages_kernel(k, v, 1, k_new, v_new, slots, tokens_per_step=8,
                                interpret=params)
    assert not interpret_pallas_call.races.races_found
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_kernel_rejects_bad_shapes():
    pages = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="do not fit"):
        write_kv_pages_kernel(pages, pages, 0, jnp.zeros((4, 2, 32)), jnp.zeros((4, 2, 32)),
                              jnp.zeros(4, jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hkv, d, page", [(3, 64, 16), (8, 128, 128)])
def test_kernel_lowers_for_tpu(dtype, hkv, d, page):
    sds = jax.ShapeDtypeStruct
    pages = sds((28, hkv, 64, page, d), dtype)
    new = sds((256, hkv, d), dtype)

    def fn(k, v, layer, k_new, v_new, slots):
        return write_kv_pages_kernel(k, v, layer, k_new, v_new, slots)

    mlir = tpu_export(fn, pages, pages, sds((), jnp.int32), new, new, sds((256,), jnp.int32))
    assert "tpu_custom_call" in mlir
