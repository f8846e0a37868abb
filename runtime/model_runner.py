"""Runs forwards on a group of devices: the params, the KV pool, and one compiled program per
bucket. The group is one tensor-parallel mesh (model.sharding); one device is a mesh of one.

Programs are compiled ahead of time per (BatchShape, with_logsumexp), explicitly, so every
compilation is counted and a batch never silently retraces.
"""
import concurrent.futures
import functools
import os
import threading

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.attention_plan import BlockSizes
from model.batch import ForwardBatch, KVCache
from model.config import ModelConfig
from model.decoder import empty_cache, score_forward
from model.sharding import (
    CACHE_SPECS,
    TP_AXIS,
    param_specs,
    repeat_kv_heads,
    shard_forward,
    shard_plan,
)
from runtime.batch_builder import build_batch
from runtime.buckets import BatchShape, ShapeBuckets


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, buckets: ShapeBuckets, num_pages: int,
                 dtype, backend: str, devices=None):
        """`params` on the host (model.params); `devices`: the mesh, by default the first."""
        self.cfg, self.buckets = cfg, buckets
        self.num_pages, self.dtype, self.backend = num_pages, dtype, backend
        devices = list(devices or jax.devices()[:1])
        self.shards = shard_plan(cfg, len(devices))
        self.mesh = Mesh(np.array(devices), (TP_AXIS,))
        params = repeat_kv_heads(params, cfg, self.shards.kv_repeat)
        self.params = jax.device_put(params, self._shardings(param_specs(params, self.shards)))
        self.cache = self._new_cache()
        self.publish = None  # multi-host node 0: the step channel's publish (runtime.distributed)
        self._programs = {}
        self._compile_lock = threading.Lock()
        self.compile_count = 0

    @property
    def sizes(self) -> BlockSizes | None:
        return self.buckets.sizes

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.buckets.page_size

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    def _shardings(self, specs):
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def _new_cache(self) -> KVCache:
        """Zeros made in place, each device holding its own KV heads only."""
        make = functools.partial(empty_cache, self.cfg, self.num_pages, self.buckets.page_size,
                                 self.dtype, self.shards.kv_repeat)
        return jax.jit(make, out_shardings=self._shardings(CACHE_SPECS))()

    def _program(self, batch: ForwardBatch, shape: BatchShape, with_lse: bool):
        key = (shape, with_lse)
        if key not in self._programs:
            forward = functools.partial(
                score_forward, cfg=self.cfg, max_q_len=shape.tokens, with_logsumexp=with_lse,
                backend=self.backend, sizes=self.sizes, shards=self.shards)
            sharded = shard_forward(forward, self.mesh, self.params, self.shards)
            program = jax.jit(sharded, donate_argnums=1).lower(
                self.params, self.cache, batch).compile()
            with self._compile_lock:
                self._programs[key] = program
                self.compile_count += 1
        return self._programs[key]

    def warm_up(self, threads: int = os.cpu_count() or 1) -> None:
        """Compiles every bucket, with and without the logsumexp, on `threads` threads
        (XLA compiles outside the GIL)."""
        def compile_one(job):
            shape, with_lse = job
            batch = build_batch([], [], shape, self.buckets.page_size, self.num_slots, self.sizes)
            self._program(batch, shape, with_lse)

        jobs = [(shape, lse) for shape in self.buckets.all_shapes() for lse in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(compile_one, jobs))

    def run(self, batch: ForwardBatch, shape: BatchShape, with_lse: bool):
        """Label logits [rows, labels] and logsumexp [rows] (zeros without) as float64."""
        try:
            program = self._program(batch, shape, with_lse)
            if self.publish is not None:
                self.publish(shape, with_lse, batch)
            logits, lse, self.cache = program(self.params, self.cache, batch)
            logits = np.asarray(logits, np.float64)
            lse = np.asarray(lse, np.float64) if with_lse else np.zeros(len(logits))
        except BaseException:
            self._restore_cache()
            raise
        return logits, lse

    def _restore_cache(self) -> None:
        """A step that failed after taking the donated cache leaves it deleted: start a new one."""
        if self.cache.k.is_deleted() or self.cache.v.is_deleted():
            self.cache = self._new_cache()
