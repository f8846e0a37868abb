"""The server's own programs compiled for TPU v6e by the real TPU compiler (deviceless
topologies, abstract weights), and the KV pool updated in place on every backend.

Each program is built by runtime.forward_programs.server_programs, as the Engine builds its
replicas' programs. Cost on 2 cores: a v6e program takes 3 s (16 tokens) to 21 s (6144) to
compile, the embedded model's 29 buckets 5 minutes (`python -m profiling.bench_tpu_compile`
compiles any of them); so the embedded model compiles one bucket of each kind of kernel
operand shapes, and every other configuration one bucket, or the largest where memory is
the question.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.decoder import norms_in_kernels, projection_shapes
from model.config import int8_config
from model.params import param_dtypes, param_shapes
from profiling.v6e.compile import (
    SIZED_MODELS,
    V6E_HBM_BYTES,
    hbm_bytes,
    mosaic_kernels,
    v6e_devices,
)
from profiling.v6e.forward_estimate import ESTIMATE_POOL_PAGES
from profiling.v6e.hlo_ops import kernel_operands_in_vmem
from runtime.engine_config import EngineConfig
from runtime.forward_programs import server_programs
from runtime.pool_size import DeviceMemory, kv_pool_pages

# The label gather's kernels: tiles or streaming (with or without the logsumexp), chosen at
# run time; every sized model's heads take the norm and RoPE kernel.
KERNELS = ["label_gather_rows", "label_gather_streamed", "qk_norm_rope",
           "ragged_paged_attention", "write_kv_pages"]
# From 512 tokens, where a shard's weights are whole lane tiles (kernels.projection_kernel):
# every projection of a layer, on its kernel, q's and k's with their norm and RoPE, and k and
# v into their pages (heads of 64 each into a lane tile of the pool's): no KV-write kernel.
INTO_PAGES = sorted([k for k in KERNELS if k not in ("qk_norm_rope", "write_kv_pages")]
                    + ["gate_up", "project_down", "project_kv", "project_out", "project_q"])
# From 2048 tokens, where the MLP's weights fit VMEM (kernels.mlp_kernel): the MLP in one
# kernel, after the output projection on one chip; split, the output projection's partial
# sums are all-reduced before its residual add, so it keeps its own kernel.
MLP_SPLIT = sorted([k for k in INTO_PAGES if k not in ("gate_up", "project_down")] + ["mlp"])
MLP_WHOLE = sorted([k for k in MLP_SPLIT if k not in ("mlp", "project_out")]
                   + ["out_and_mlp"])
POOL_PAGES = 2048  # 32k tokens, the server's default pool on CPU


def assert_in_place(programs, compiled) -> None:
    """The donated pool is the output's (aliased), and nothing near its size is copied."""
    memory = hbm_bytes(compiled)
    assert memory["alias"] >= programs.pool_bytes
    assert memory["temp"] < programs.pool_bytes // 10, memory


def shape_kinds(shapes: list, q_block: int) -> list:
    """The first bucket of each kind: a kind is how the kernels' operands sit against their
    blocks (tokens below the q block, a multiple of it, or neither) and against the budgets
    (sequences and scored rows as many as the tokens, or capped)."""
    def kind(s):
        return (s.tokens < q_block, s.tokens % q_block == 0, s.seqs == s.tokens,
                s.rows == s.tokens)
    return sorted({kind(s): s for s in reversed(shapes)}.values(), key=lambda s: s.tokens)


def test_server_programs_of_the_embedded_model_compile_for_v6e(embedded_config):
    """A bucket of each kind of the 29 at the default budgets. The largest bucket (8192
    tokens) compiles in test_default_pool_fits_a_32_gib_v6e, for a larger model."""
    programs = server_programs(EngineConfig(dtype="bfloat16"), embedded_config,
                               v6e_devices(1), POOL_PAGES)
    assert programs.backend == "pallas"
    all_shapes = programs.buckets.all_shapes()
    shapes = shape_kinds(all_shapes, programs.buckets.sizes.q_block)
    assert len(all_shapes) == 29
    assert [s.tokens for s in shapes] == [16, 96, 256, 320, 512]
    programs.warm_up(threads=2, shapes=shapes)
    assert programs.compile_count == len(shapes)
    for shape in shapes:  # its hidden size, 576, is not whole lane tiles
        compiled = programs.get(shape)
        assert mosaic_kernels(compiled) == KERNELS, shape
        assert_in_place(programs, compiled)


# TP 1 of Qwen3-0.6B: its largest program, in the test after this one. Whether a shard's
# projections take their kernel: Qwen2.5-0.5B's q is 448 wide a shard at TP 2. Heads of 64
# (Qwen2.5-0.5B, Llama-3.2-1B) come from the attention a lane tile each to the output
# projection's kernel, whole at TP 1 and split by rows at TP 4 (and to the MLP kernel's in
# the int8 test below).
TENSOR_PARALLEL = [("SmolLM2-135M", 3, 512, KERNELS), ("Qwen3-0.6B", 4, 2048, MLP_SPLIT),
                   ("Qwen2.5-0.5B", 1, 512, INTO_PAGES),
                   ("Qwen2.5-0.5B", 2, 512, KERNELS),
                   ("Llama-3.2-1B", 4, 512, INTO_PAGES)]  # Qwen2.5's 14 heads: no TP 4


def assert_weights_stay_in_hbm(compiled) -> None:
    """XLA copies no weight stack into VMEM around the kernels that read them where they lie
    (kernels.projection_kernel.in_hbm: Qwen2.5-0.5B's q stack was, every layer, beside the MLP
    kernel: 38.5 MB in bfloat16, 19 MB in int8)."""
    assert max(kernel_operands_in_vmem(compiled.as_text()), default=0) < 1 << 20


@pytest.mark.parametrize("model, tp, tokens, kernels", TENSOR_PARALLEL)
def test_sized_model_programs_compile_for_v6e(model, tp, tokens, kernels):
    """One bucket, on one chip or split over a 2x2 slice, with the v6e estimates' pool."""
    cfg = SIZED_MODELS[model]
    programs = server_programs(EngineConfig(dtype="bfloat16", tp_size=tp), cfg,
                               v6e_devices(1 if tp == 1 else 4)[:tp], ESTIMATE_POOL_PAGES)
    compiled = programs.get(programs.buckets.shape(tokens))
    assert mosaic_kernels(compiled) == kernels
    assert_in_place(programs, compiled)
    assert_weights_stay_in_hbm(compiled)
    assert ("all-reduce" in compiled.as_text()) == (tp > 1)
    if tp > 1:  # each chip holds its own KV heads only
        assert programs.pool_bytes * tp == server_programs(
            EngineConfig(dtype="bfloat16"), cfg, v6e_devices(1),
            ESTIMATE_POOL_PAGES).pool_bytes


def test_an_int8_models_program_compiles_for_v6e():
    """Qwen2.5-0.5B in int8 (W8A8) at 2,048 tokens, with the v6e estimates' pool: q's and
    k/v's projections on their kernel and the layer after attention in one (the attention's
    heads of 64 taken in their lane tiles), int8 weights read at the layer where they lie in
    HBM, x quantized in the kernels after the input norms they apply, the pool updated in
    place; its arguments the pool, the batch and the weights at a byte each (bfloat16
    embeddings, biases and norms, float32 scales)."""
    cfg = int8_config(SIZED_MODELS["Qwen2.5-0.5B"])
    programs = server_programs(EngineConfig(dtype="bfloat16"), cfg, v6e_devices(1),
                               ESTIMATE_POOL_PAGES)
    compiled = programs.get(programs.buckets.shape(2048))
    widths = [projection_shapes(cfg)[k][1] for k in ("project_q", "project_kv", "gate_up")]
    assert all(norms_in_kernels(cfg, 2048, *widths, itemsize=1))
    assert mosaic_kernels(compiled) == MLP_WHOLE
    assert_in_place(programs, compiled)
    assert_weights_stay_in_hbm(compiled)
    shapes, dtypes = param_shapes(cfg), param_dtypes(cfg, jnp.bfloat16)
    weights = sum(np.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in zip(
        jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.leaves(dtypes)))
    assert hbm_bytes(compiled)["argument"] - programs.pool_bytes == pytest.approx(weights,
                                                                                  rel=0.01)


def test_default_pool_fits_a_32_gib_v6e():
    """The pool the server sizes for one v6e chip (default --mem-fraction 0.8), beside the
    weights and the largest program's temp, all read from compiled programs: Qwen3-0.6B, the
    rerankers' size (each model costs two compiles of its largest program, 25 s each)."""
    cfg, engine_cfg = SIZED_MODELS["Qwen3-0.6B"], EngineConfig(dtype="bfloat16")
    chip = v6e_devices(1)
    programs_with = functools.partial(server_programs, engine_cfg, cfg, chip)
    pages = kv_pool_pages(engine_cfg, programs_with, DeviceMemory(V6E_HBM_BYTES))
    programs = programs_with(pages)
    assert programs.pool_bytes > 0.6 * V6E_HBM_BYTES  # most of the chip goes to the pool
    compiled = programs.get(programs.buckets.all_shapes()[-1])
    assert mosaic_kernels(compiled) == MLP_WHOLE
    assert_in_place(programs, compiled)
    assert hbm_bytes(compiled)["total"] <= engine_cfg.mem_fraction * V6E_HBM_BYTES


def test_a_pool_that_cannot_hold_one_batch_is_refused():
    """1.2 GiB of the chip are left for 1.1 GiB of weights: no room for a batch's KV."""
    cfg = SIZED_MODELS["Qwen3-0.6B"]
    engine_cfg = EngineConfig(dtype="bfloat16", max_prefill_tokens=512)
    programs_with = functools.partial(server_programs, engine_cfg, cfg, v6e_devices(1))
    with pytest.raises(ValueError, match="--mem-fraction 0.8 of 1.5 GiB"):
        kv_pool_pages(engine_cfg, programs_with, DeviceMemory(3 * 2**29))


@pytest.mark.parametrize("backend, tp", [("xla", 1), ("xla", 3), ("reference", 1)])
def test_cpu_programs_update_the_pool_in_place(backend, tp, embedded_config):
    """The same rule off TPU: temp does not grow with the pool."""
    engine_cfg = EngineConfig(kernel_backend=backend, tp_size=tp, max_prefill_tokens=512)
    programs = server_programs(engine_cfg, embedded_config, jax.devices()[:tp], POOL_PAGES)
    assert_in_place(programs, programs.get(programs.buckets.shape(512)))
