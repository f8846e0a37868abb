"""Runs forwards on the device: the params, the KV pool, and one compiled program per bucket.

Programs are compiled ahead of time per (BatchShape, with_logsumexp), explicitly, so every
compilation is counted and a batch never silently retraces.
"""
import concurrent.futures
import os
import threading

import jax
import numpy as np

from kernels.attention_plan import BlockSizes
from model.batch import ForwardBatch
from model.config import ModelConfig
from model.decoder import empty_cache, score_forward
from runtime.batch_builder import build_batch
from runtime.buckets import BatchShape, ShapeBuckets


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, buckets: ShapeBuckets, num_pages: int,
                 dtype, backend: str):
        self.cfg, self.params, self.buckets = cfg, params, buckets
        self.num_pages, self.dtype, self.backend = num_pages, dtype, backend
        self.cache = self._new_cache()
        self._jitted = jax.jit(score_forward, donate_argnames=("cache",), static_argnames=(
            "cfg", "max_q_len", "with_logsumexp", "backend", "sizes"))
        self._programs = {}
        self._compile_lock = threading.Lock()
        self.compile_count = 0

    @property
    def sizes(self) -> BlockSizes | None:
        return self.buckets.sizes

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.buckets.page_size

    def _new_cache(self):
        return empty_cache(self.cfg, self.num_pages, self.buckets.page_size, self.dtype)

    def _program(self, batch: ForwardBatch, shape: BatchShape, with_lse: bool):
        key = (shape, with_lse)
        if key not in self._programs:
            program = self._jitted.lower(
                self.params, self.cache, batch, cfg=self.cfg, max_q_len=shape.tokens,
                with_logsumexp=with_lse, backend=self.backend, sizes=self.sizes).compile()
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
