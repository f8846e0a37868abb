"""The compiled forwards of one device group: one program per BatchShape (whether to compute
the logsumexp is the batch's choice, at run time), compiled ahead of time and explicitly, so
every compilation is counted and a batch never silently retraces. A program takes the params,
the KV pool (donated) and the batch packed into one vector (model.batch.pack).

Built from placed arrays (ModelRunner) or from the model's shapes alone (`abstract_programs`),
the lowering is the same: a program compiled here for a deviceless TPU topology is the one a
server on that TPU runs.
"""
import concurrent.futures
import contextlib
import functools
import os
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.backends import TPU_BACKENDS, KernelSet
from model.batch import KVCache, pack, unpack
from model.config import ModelConfig
from model.decoder import kv_pool_shape, score_forward
from model.loader import DTYPES
from model.params import grouped_kv_shapes, param_dtype, param_shapes
from model.sharding import (
    ShardPlan,
    cache_placements,
    param_placements,
    repeat_kv_shapes,
    shard_forward,
    shard_plan,
    tp_mesh,
)
from runtime.batch_builder import build_batch
from runtime.buckets import BatchShape, ShapeBuckets
from runtime.engine_config import EngineConfig
from runtime.program_cache import ProgramCache

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # JAX's monitoring event

# XLA options of the forward by platform, set per program so that other programs of the
# process keep the defaults. On CPU, XLA hands dots to YNNPACK by default; its own (Eigen) dots
# run the attention loop's small batched matmuls ([3, 192, 64] x [3, 64, 128]) 1.5x faster
# and the layers' matmuls no slower (docs/cpu_forward_log.md).
COMPILER_OPTIONS = {"cpu": {"xla_cpu_experimental_ynn_fusion_type": ""}}


def matmul_precision(dtype) -> str | None:
    """float32 programs multiply in float32 on every device. At the default precision a GPU
    rounds float32 operands to TF32 and a TPU to bfloat16: on an H200 a float32 forward then
    moved log scores by up to 5e-3 between two batchings of the same prompts. None: the
    default, which is exact for bfloat16 operands."""
    return "float32" if np.dtype(dtype) == np.float32 else None


@contextlib.contextmanager
def _xla_cache_hits():
    """A list that gets an entry for each program the calling thread reads from JAX's
    compilation cache while the context is open (JAX reports a hit in the compiling thread)."""
    thread, hits = threading.get_ident(), []

    def listener(event, **_):
        if event == CACHE_HIT_EVENT and threading.get_ident() == thread:
            hits.append(event)
    jax.monitoring.register_event_listener(listener)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(listener)


def footprint(compiled: jax.stages.Compiled) -> int:
    """Bytes a program holds on each device: arguments, temp, and outputs that do not reuse
    (alias) a donated argument."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)


def _abstract(tree):
    """Arrays as ShapeDtypeStructs that keep their sharding and layout."""
    def one(x):
        return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.format)
    return jax.tree.map(one, tree)


class ForwardPrograms:
    def __init__(self, cfg: ModelConfig, buckets: ShapeBuckets, backend: str, mesh,
                 shards: ShardPlan, params: dict, cache: KVCache,
                 program_cache_dir: str = ""):
        """`params` and `cache`: arrays, or jax.ShapeDtypeStructs placed (sharding and layout)
        as the arrays the programs will be given. `program_cache_dir`: where compiled programs
        are kept for the next start (runtime.program_cache); "": nowhere."""
        self.cfg, self.buckets, self.backend = cfg, buckets, backend
        self.mesh, self.shards = mesh, shards
        self.compiler_options = COMPILER_OPTIONS.get(mesh.devices.flat[0].platform, {})
        self._params, self._cache = _abstract(params), _abstract(cache)
        self._programs = {}
        self._lock = threading.Lock()
        self.compile_count = 0  # programs compiled, not read from the program cache
        self.xla_cache_hit_count = 0  # of those, programs JAX's compilation cache had
        self._disk = ProgramCache(program_cache_dir, list(mesh.devices.flat), cfg, buckets,
                                  backend, shards, self._params,
                                  self._cache) if program_cache_dir else None

    @property
    def num_pages(self) -> int:
        """Pages to hand out: the pool's last takes padding (model.decoder.kv_pool_shape)."""
        return self._cache.k.shape[2] - 1

    @property
    def pool_bytes(self) -> int:
        """The KV pool on one device."""
        k = self._cache.k
        return 2 * int(np.prod(k.sharding.shard_shape(k.shape))) * k.dtype.itemsize

    def lower(self, shape: BatchShape, kernels: KernelSet | None = None) -> jax.stages.Lowered:
        """`kernels`: instead of the backend's (profiling.bench_ablation)."""
        forward = functools.partial(
            score_forward, cfg=self.cfg, max_q_len=shape.tokens, backend=self.backend,
            sizes=self.buckets.sizes, shards=self.shards, kernels=kernels)
        sharded = shard_forward(forward, self.mesh, self._params, self.shards)
        like = build_batch([], [], shape, self.buckets.page_size,
                           page_aligned=self.buckets.page_aligned)

        def packed_forward(params, cache, packed):
            return sharded(params, cache, unpack(packed, like))
        packed = jax.ShapeDtypeStruct(pack(like).shape, np.int32,
                                      sharding=NamedSharding(self.mesh, P()))
        with jax.default_matmul_precision(matmul_precision(self._cache.k.dtype)):
            return jax.jit(packed_forward, donate_argnums=1).lower(self._params, self._cache,
                                                                   packed)

    def get(self, shape: BatchShape) -> jax.stages.Compiled:
        if shape not in self._programs:
            name = repr(shape)
            program = self._disk.load(name) if self._disk else None
            compiled, hits = program is None, []
            if compiled:
                with _xla_cache_hits() as hits:
                    program = self.lower(shape).compile(self.compiler_options)
                # XLA CPU serializes a program it read from JAX's cache without its fused
                # kernels: stored, it would fail every forward of the next start.
                if self._disk and not hits:
                    self._disk.store(name, program)
            with self._lock:
                self._programs[shape] = program
                self.compile_count += compiled
                self.xla_cache_hit_count += bool(hits)
        return self._programs[shape]

    def warm_up(self, threads: int = os.cpu_count() or 1,
                shapes: list[BatchShape] | None = None, progress_s: float = 10.0) -> None:
        """Compiles `shapes` (default: every bucket) on `threads` threads (XLA compiles outside
        the GIL), logging its progress every `progress_s` and, at the end, how many programs
        were read from a cache."""
        shapes = self.buckets.all_shapes() if shapes is None else shapes
        compiled_before, hits_before = self.compile_count, self.xla_cache_hit_count
        start = last = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(self.get, shape) for shape in shapes]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                future.result()
                if time.monotonic() - last >= progress_s and done < len(shapes):
                    last = time.monotonic()
                    logging.info("preparing %d/%d programs, %.0f s", done, len(shapes),
                                 last - start)
        compiled = self.compile_count - compiled_before
        logging.info("%d programs ready in %.0f s: %d read from the program cache, %d compiled "
                     "(%d of them found in JAX's compilation cache)", len(shapes),
                     time.monotonic() - start, len(shapes) - compiled, compiled,
                     self.xla_cache_hit_count - hits_before)


def abstract_programs(cfg: ModelConfig, dtype, buckets: ShapeBuckets, backend: str, devices,
                      num_pages: int) -> ForwardPrograms:
    """The programs a ModelRunner on `devices` compiles, from the model's shapes: no weights,
    and `devices` may be a deviceless topology's (jax.experimental.topologies)."""
    shards, mesh = shard_plan(cfg, len(devices)), tp_mesh(devices)
    shapes = repeat_kv_shapes(param_shapes(cfg), shards.kv_repeat)
    if backend in TPU_BACKENDS:
        shapes = grouped_kv_shapes(shapes)  # as ModelRunner holds them
    params = jax.tree_util.tree_map_with_path(
        lambda path, shape, placement: jax.ShapeDtypeStruct(
            shape, param_dtype(cfg, path[-1].key, dtype), sharding=placement),
        shapes, param_placements(shapes, shards, mesh), is_leaf=lambda x: isinstance(x, tuple))
    pool = kv_pool_shape(cfg, num_pages, buckets.page_size, backend, shards.kv_repeat)
    cache = KVCache(*(jax.ShapeDtypeStruct(pool, dtype, sharding=placement)
                      for placement in cache_placements(mesh)))
    return ForwardPrograms(cfg, buckets, backend, mesh, shards, params, cache)


def server_programs(engine_cfg: EngineConfig, cfg: ModelConfig, devices,
                    num_pages: int) -> ForwardPrograms:
    """The programs a server with `engine_cfg` compiles for a replica on `devices`."""
    device = devices[0]
    return abstract_programs(cfg, DTYPES[engine_cfg.dtype], engine_cfg.buckets(cfg, device),
                             engine_cfg.backend(device), devices, num_pages)
