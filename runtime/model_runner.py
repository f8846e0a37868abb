"""Runs forwards on a group of devices: the params, the KV pool, and the compiled programs
(runtime.forward_programs). The group is one tensor-parallel mesh (model.sharding); one device
is a mesh of one.
"""
import functools
import os
from typing import Callable, NamedTuple

import jax
import numpy as np

from kernels.attention_plan import BlockSizes
from kernels.backends import TPU_BACKENDS
from kernels.int8 import int8_runs_on
from model.batch import ForwardBatch, KVCache, pack
from model.config import ModelConfig
from model.decoder import empty_cache
from model.params import grouped_kv, per_layer_matrices
from model.sharding import (
    cache_placements,
    param_placements,
    repeat_kv_heads,
    shard_plan,
    tp_mesh,
)
from runtime.buckets import BatchShape, ShapeBuckets
from runtime.forward_programs import ForwardPrograms

Publish = Callable[[BatchShape, np.ndarray], None]  # the batch, packed


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, buckets: ShapeBuckets, num_pages: int,
                 dtype, backend: str, devices=None, publish: Publish | None = None,
                 program_cache_dir: str = ""):
        """`params` on the host (model.params); `devices`: the mesh, by default the first.
        `publish`: multi-host node 0's step channel (runtime.distributed), told each forward.
        `program_cache_dir`: where compiled programs are kept between starts; "": nowhere."""
        self.cfg, self.buckets = cfg, buckets
        self.num_pages, self.dtype, self.backend = num_pages, dtype, backend
        devices = list(devices or jax.devices()[:1])
        self.shards, self.mesh = shard_plan(cfg, len(devices)), tp_mesh(devices)
        params = repeat_kv_heads(params, cfg, self.shards.kv_repeat)
        if cfg.quantization and not int8_runs_on(devices[0]):
            raise ValueError(f"--quantization {cfg.quantization} needs a TPU v5e, v5p or v6e "
                             f"(int8 into int32 on the MXU), not a {devices[0].device_kind}: "
                             "serve a 16-bit checkpoint without --quantization")
        if backend in TPU_BACKENDS:
            params = grouped_kv(params)  # stacked as the TPU kernels read them
        elif devices[0].platform == "cpu":
            params = per_layer_matrices(params)
        self.params = jax.device_put(params, param_placements(params, self.shards, self.mesh))
        self._new_cache = self._cache_maker()
        self.cache = self._new_cache()
        self.programs = ForwardPrograms(cfg, buckets, backend, self.mesh, self.shards,
                                        self.params, self.cache, program_cache_dir)
        self._publish = publish

    @property
    def sizes(self) -> BlockSizes | None:
        return self.buckets.sizes

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def compile_count(self) -> int:
        return self.programs.compile_count

    def _cache_maker(self) -> Callable[[], KVCache]:
        """A new pool: zeros made in place, each device holding its own KV heads only."""
        make = functools.partial(empty_cache, self.cfg, self.num_pages, self.buckets.page_size,
                                 self.dtype, self.backend, self.shards.kv_repeat)
        return jax.jit(make, out_shardings=cache_placements(self.mesh))

    def warm_up(self, threads: int = os.cpu_count() or 1) -> None:
        self.programs.warm_up(threads)

    def dispatch(self, batch: ForwardBatch, shape: BatchShape) -> "Pending":
        """Starts a forward on the devices and returns at once (JAX dispatches
        asynchronously); its results come from `collect`. Forwards run in the order they were
        dispatched: each takes the KV pool the one before it gives back (donated)."""
        try:
            program, packed = self.programs.get(shape), pack(batch)
            if self._publish is not None:
                self._publish(shape, packed)
            logits, lse, self.cache = program(self.params, self.cache, packed)
        except BaseException:
            self._restore_cache()
            raise
        return Pending(logits, lse)

    def collect(self, pending: "Pending") -> tuple[np.ndarray, np.ndarray]:
        """A dispatched forward's label logits [rows, labels] and logsumexp [rows] (zeros
        unless the batch asked for it) as float64; waits for it. A device fault raises here,
        and then the pool this runner holds may be poisoned: see `reset_cache`."""
        return np.asarray(pending.logits, np.float64), np.asarray(pending.lse, np.float64)

    def run(self, batch: ForwardBatch, shape: BatchShape) -> tuple[np.ndarray, np.ndarray]:
        """dispatch, then collect."""
        pending = self.dispatch(batch, shape)
        try:
            return self.collect(pending)
        except BaseException:
            self.reset_cache()
            raise

    def reset_cache(self) -> None:
        """A new, zeroed KV pool: after a fault, the old one may hold an error (a forward that
        failed on the device passes it on to every forward dispatched after it)."""
        self.cache = self._new_cache()

    def _restore_cache(self) -> None:
        """A step that failed after taking the donated cache leaves it deleted: start a new one."""
        if self.cache.k.is_deleted() or self.cache.v.is_deleted():
            self.reset_cache()


class Pending(NamedTuple):
    """A dispatched forward's outputs, on the devices."""
    logits: jax.Array
    lse: jax.Array
