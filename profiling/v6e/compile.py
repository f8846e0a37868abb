"""Compiling for TPU v6e on a machine without a TPU: the real TPU compiler (libtpu, Mosaic
included) against a deviceless v6e topology.

Lowering (`jax.export`) stops before Mosaic; this catches what only the compiler sees: a DMA or
slice that does not start on a tile boundary, VMEM overflow, and what a program holds in HBM
(`memory_analysis()`: a buffer copied on every call shows up as temp).
"""
import re

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from profiling.v6e.roofline import V6E_FLOPS
from runtime.forward_programs import footprint

V6E_HBM_BYTES = 32 * 2**30  # one v6e chip

# Sized as the HF checkpoints' config.json, in ModelConfig's field order: family, vocab,
# hidden, intermediate, layers, heads, KV heads, head_dim, rope theta, RMS eps, context.
# Llama-3.2-1B without its rope scaling, which the package does not serve. Shapes for
# compiling: no weights.
SIZED_MODELS = {
    "SmolLM2-135M": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 8192,
                                tie_word_embeddings=True),
    "Qwen3-0.6B": ModelConfig("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e6, 1e-6, 40960,
                              tie_word_embeddings=True),
    "Qwen2.5-0.5B": ModelConfig("qwen2", 151936, 896, 4864, 24, 14, 2, 64, 1e6, 1e-6, 32768,
                                tie_word_embeddings=True, qkv_bias=True),
    "Llama-3.2-1B": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 1e-5,
                                131072, tie_word_embeddings=True),
}
# The larger Qwen3 rerankers' sizes (Qwen3-Reranker-4B and -8B are these models): compiled by
# the studies only, a program of theirs takes minutes.
LARGE_MODELS = {
    "Qwen3-4B": ModelConfig("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, 1e6, 1e-6, 40960,
                            tie_word_embeddings=True),
    "Qwen3-8B": ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e6, 1e-6, 40960),
}
STUDY_MODELS = {**SIZED_MODELS, **LARGE_MODELS}
_GEMMA = dict(tie_word_embeddings=True, norm_offset=1.0, embed_scale=True,
              activation="gelu_tanh", sandwich_norms=True, query_scale=256.0)
# The windowed families' sizes, for random checkpoints (profiling.random_checkpoint) and the v6e
# studies (profiling.v6e.forward_breakdown); not in the suite's compile checks of every model.
WINDOWED_MODELS = {
    "Gemma-2-2B": ModelConfig("gemma2", 256000, 2304, 9216, 26, 8, 4, 256, 10000.0, 1e-6, 8192,
                              attn_softcap=50.0, final_softcap=30.0,
                              layer_windows=tuple(4096 * (i % 2 == 0) for i in range(26)),
                              **_GEMMA),
    "Gemma-3-1B": ModelConfig("gemma3", 262144, 1152, 6912, 26, 4, 1, 256, 1e6, 1e-6, 32768,
                              local_rope_theta=10000.0,
                              layer_windows=tuple(512 * ((i + 1) % 6 != 0) for i in range(26)),
                              **_GEMMA),
}


def v6e_devices(chips: int = 1) -> list:
    """The devices of a deviceless v6e topology: one chip (1x1) or four (2x2)."""
    if chips == 1:  # plain "v6e:1x1" does not divide the default 2x2x1 chips per host
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name="v6e:1x1", chip_config_name="default",
            chips_per_host_bounds=(1, 1, 1), num_slices=1)
    elif chips == 4:
        topology = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2")
    else:
        raise ValueError(f"a v6e topology of 1 or 4 chips, not {chips}")
    return list(topology.devices)


def compile_for_v6e(fn, *args, donate_argnums=()) -> jax.stages.Compiled:
    """`fn(*args)` compiled for one v6e chip; `args` are arrays or ShapeDtypeStructs (trees)."""
    chip = NamedSharding(Mesh(np.array(v6e_devices(1)), ("x",)), P())
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=chip), args)
    return jax.jit(fn, donate_argnums=donate_argnums).lower(*structs).compile()


def hbm_bytes(compiled: jax.stages.Compiled) -> dict:
    """Per device: what a program's arguments, outputs and temp take, and how much of the
    outputs reuse (alias) donated arguments."""
    m = compiled.memory_analysis()
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "total": footprint(compiled)}


def xla_costs(compiled: jax.stages.Compiled) -> dict:
    """XLA's cost_analysis() of a compiled program: FLOPs, HBM bytes and its own v6e time
    estimate (None where it gives none; a Pallas call counts its CostEstimate, or nothing)."""
    cost = compiled.cost_analysis()
    optimal = cost.get("optimal_seconds", -1.0)
    return {"flops": cost.get("flops", 0.0), "hbm_bytes": cost.get("bytes accessed", 0.0),
            "optimal_s": optimal if optimal > 0 else None}  # < 0: not estimated


# How XLA's cost_analysis() prices a Pallas call: the larger of its CostEstimate's FLOPs at
# the bf16 peak and its bytes at this rate (checked in tests/test_tpu_schedule.py); a call
# without a CostEstimate costs nothing.
XLA_V6E_HBM = 1.638e12


def xla_priced_s(flops: float, hbm_bytes: float) -> float:
    """What XLA's optimal_seconds charges for a Pallas call with this CostEstimate."""
    return max(flops / V6E_FLOPS, hbm_bytes / XLA_V6E_HBM)


def mosaic_kernels(compiled: jax.stages.Compiled) -> list[str]:
    """The Pallas kernels a compiled TPU program calls, by name (`pallas_call(name=...)`)."""
    calls = (line for line in compiled.as_text().splitlines()
             if 'custom_call_target="tpu_custom_call"' in line)
    return sorted({m.group(1) for line in calls if (m := re.search(r"%(\w+?)(\.\d+)? = ", line))})
