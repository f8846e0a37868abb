"""Writes new tokens' K/V into their pages: the Pallas TPU kernel of `write_kv_pages`.

Each token's [Hkv, D] row is copied by DMA from HBM straight to its (page, offset) slot
of the aliased page arrays, a chunk of tokens per grid step; slots outside the pool
(padding tokens) are skipped.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(layer_ref, slots_ref, k_new, v_new, k_in, v_in, k_out, v_out, sems, *,
            tokens_per_step, page_size, num_slots):
    del k_in, v_in  # aliased to k_out, v_out
    base = pl.program_id(0) * tokens_per_step

    def copies(t):
        slot = slots_ref[base + t]
        page, offset = slot // page_size, slot % page_size
        return [pltpu.make_async_copy(src.at[base + t], dst.at[layer_ref[0], :, page, offset],
                                      sems.at[n])
                for n, (src, dst) in enumerate(((k_new, k_out), (v_new, v_out)))]

    def for_real_tokens(action):
        def body(t, carry):
            @pl.when(slots_ref[base + t] < num_slots)
            def _():
                for c in copies(t):
                    action(c)
            return carry
        jax.lax.fori_loop(0, tokens_per_step, body, 0)

    for_real_tokens(lambda c: c.start())
    for_real_tokens(lambda c: c.wait())


def write_kv_pages_kernel(k_pages, v_pages, layer, k_new, v_new, slots, *,
                          tokens_per_step: int = 64, interpret=False):
    """Same contract as `write_kv_pages`: returns the updated (k_pages, v_pages)."""
    n_layers, hkv, n_pages, page_size, d = k_pages.shape
    if k_new.shape != v_new.shape or k_new.shape[1:] != (hkv, d) or slots.shape != k_new.shape[:1]:
        raise ValueError(f"k_new {k_new.shape}, v_new {v_new.shape}, slots {slots.shape} do not "
                         f"fit pages {k_pages.shape}")
    num_slots = n_pages * page_size
    pad = -k_new.shape[0] % tokens_per_step
    slots = jnp.pad(slots.astype(jnp.int32), (0, pad), constant_values=num_slots)
    k_new = jnp.pad(k_new.astype(k_pages.dtype), ((0, pad), (0, 0), (0, 0)))
    v_new = jnp.pad(v_new.astype(v_pages.dtype), ((0, pad), (0, 0), (0, 0)))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, tokens_per_step=tokens_per_step, page_size=page_size,
                               num_slots=num_slots)
    return pl.pallas_call(
        kernel, name="write_kv_pages",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(slots.shape[0] // tokens_per_step,),
            in_specs=[any_spec] * 4, out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={4: 0, 5: 1},  # operands count the two scalar-prefetch arrays
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), slots, k_new, v_new, k_pages, v_pages)
