"""Writes new tokens' K/V into their pages: the Pallas TPU kernel of `write_kv_pages`.

Each [Hkv, page_size, D] block is copied by DMA from HBM straight to its page of the aliased
page arrays, a chunk of pages per grid step; page ids outside the pool (padding) are skipped.
Whole pages, because a DMA into a tiled HBM array must start on a tile boundary: one token
of a page is a row of an (8, 128) tile.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

PAGES_PER_STEP = 16  # pages a grid step writes


def _kernel(layer_ref, page_ids_ref, k_blocks, v_blocks, k_in, v_in, k_out, v_out, sems, *,
            pages_per_step, num_pages):
    del k_in, v_in  # aliased to k_out, v_out
    base = pl.program_id(0) * pages_per_step

    def copies(w):
        page = page_ids_ref[base + w]
        return [pltpu.make_async_copy(src.at[base + w], dst.at[layer_ref[0], :, page],
                                      sems.at[n])
                for n, (src, dst) in enumerate(((k_blocks, k_out), (v_blocks, v_out)))]

    def for_real_pages(action):
        def body(w, carry):
            @pl.when(page_ids_ref[base + w] < num_pages)
            def _():
                for c in copies(w):
                    action(c)
            return carry
        jax.lax.fori_loop(0, pages_per_step, body, 0)

    for_real_pages(lambda c: c.start())
    for_real_pages(lambda c: c.wait())


def write_kv_pages_kernel(k_pages, v_pages, layer, k_blocks, v_blocks, page_ids, *,
                          pages_per_step: int = PAGES_PER_STEP, interpret=False):
    """Same contract as `write_kv_pages`: returns the updated (k_pages, v_pages)."""
    n_layers, hkv, num_pages, page_size, d = k_pages.shape
    block = (hkv, page_size, d)
    if (k_blocks.shape != v_blocks.shape or k_blocks.shape[1:] != block
            or page_ids.shape != k_blocks.shape[:1]):
        raise ValueError(f"k_blocks {k_blocks.shape}, v_blocks {v_blocks.shape}, page_ids "
                         f"{page_ids.shape} do not fit pages {k_pages.shape}")
    pad = -page_ids.shape[0] % pages_per_step
    page_ids = jnp.pad(page_ids.astype(jnp.int32), (0, pad), constant_values=num_pages)
    k_blocks, v_blocks = (jnp.pad(b.astype(k_pages.dtype), ((0, pad), (0, 0), (0, 0), (0, 0)))
                          for b in (k_blocks, v_blocks))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, pages_per_step=pages_per_step, num_pages=num_pages)
    return pl.pallas_call(
        kernel, name="write_kv_pages",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(page_ids.shape[0] // pages_per_step,),
            in_specs=[any_spec] * 4, out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={4: 0, 5: 1},  # operands count the two scalar-prefetch arrays
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), page_ids, k_blocks, v_blocks, k_pages,
      v_pages)
