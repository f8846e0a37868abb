"""Continuous batching: waiting units of every request share ragged forwards (CONTRACT §4-§5).

One thread owns the page pool, the prefix cache and the device. It takes waiting units in the
order of its `WaitQueue` (fair or first come, first served) until the next would break a
budget (tokens, sequences, rows, pages), so no unit is overtaken within that order. A unit
reuses the cached pages of its query; pages it computes are cached when the batch is formed,
so units behind it in the same forward share them too (every layer writes all new K/V before
any token attends).
"""
import dataclasses
import threading

import jax
from absl import logging

from runtime.batch_builder import ScheduledSeq, build_batch
from runtime.buckets import ShapeBuckets, pages_needed
from runtime.errors import ScoreError
from runtime.job import Job, Unit
from runtime.model_runner import ModelRunner
from runtime.packing import cacheable_len
from runtime.pages import PagePool
from runtime.prefix_cache import PrefixCache
from runtime.wait_queue import WaitQueue


@dataclasses.dataclass
class SchedulerStats:
    forwards: int = 0
    failed_forwards: int = 0
    computed_tokens: int = 0
    padded_tokens: int = 0   # the buckets' tokens: computed ones and their padding
    cached_tokens: int = 0   # tokens whose K/V came from the prefix cache


class Scheduler:
    def __init__(self, runner: ModelRunner, prefix_cache: bool = True, policy: str = "fair"):
        self.runner = runner
        self.buckets: ShapeBuckets = runner.buckets
        self.pool = PagePool(runner.num_pages)
        self.prefix_cache = PrefixCache(self.pool, self.buckets.page_size) if prefix_cache else None
        self.stats = SchedulerStats()
        self._waiting = WaitQueue(policy)
        self._running: list[ScheduledSeq] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job, units: list[Unit]) -> None:
        with self._cond:
            if self._closed:
                raise ScoreError("the server is shutting down", status=503)
            self._waiting.add(job, units)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def load(self) -> int:
        """Tokens queued or in the forward running: the work a new request waits behind."""
        with self._cond:
            return (sum(len(u.seq.tokens) for u in self._waiting)
                    + sum(e.new_tokens for e in self._running))

    def check_pages(self) -> None:
        """The page invariant: counts equal holders (running sequences and the cache)."""
        with self._cond:
            holders = [e.pages for e in self._running]
            self.pool.check(holders + ([self.prefix_cache.pages()] if self.prefix_cache else []))

    def flush_prefix_cache(self) -> int:
        """Drops every cached prefix nobody is using; returns the pages freed."""
        with self._cond:
            return self.prefix_cache.evict(self.pool.num_pages) if self.prefix_cache else 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                with jax.profiler.TraceAnnotation("form_batch"):
                    batch = self._form_batch()
            if batch:
                self._run(batch)
        for unit in self._waiting:
            unit.job.fail(ScoreError("the server is shutting down", status=503))

    def _form_batch(self) -> list[tuple[Unit, ScheduledSeq]]:
        batch, tokens, rows = [], 0, 0
        for unit in self._waiting.in_order():
            if len(batch) == self.buckets.max_seqs:
                break
            if not unit.job.active:
                self._waiting.drop(unit.job)
                continue
            n_rows = len(unit.seq.score_rows)
            entry = None
            if rows + n_rows <= self.buckets.max_rows:
                entry = self._reserve(unit.seq, self.buckets.max_tokens - tokens)
            if entry is None:
                if not batch:  # cannot happen with a pool sized by EngineConfig
                    self._waiting.drop(unit.job)
                    unit.job.fail(ScoreError("the KV cache cannot hold this request", 500))
                    continue
                break
            self._waiting.take(unit)
            self._running.append(entry)
            batch.append((unit, entry))
            tokens, rows = tokens + entry.new_tokens, rows + n_rows
        self._waiting.forward_formed()
        return batch

    def _reserve(self, seq, token_budget: int) -> ScheduledSeq | None:
        """Pages for `seq` (cached prefix + new), or None if the budgets cannot take it."""
        size, shareable = self.buckets.page_size, cacheable_len(seq)
        reusable = min(min(seq.score_rows), shareable) // size
        cached = self.prefix_cache.match(seq.tokens, reusable) if self.prefix_cache else []
        new = pages_needed(len(seq.tokens), size) - len(cached)
        if len(seq.tokens) - len(cached) * size > token_budget or not self._make_room(new):
            self.pool.release(cached)
            return None
        pages = cached + self.pool.allocate(new)
        if self.prefix_cache:
            self.prefix_cache.insert(seq.tokens, pages[:shareable // size])
        return ScheduledSeq(seq, pages, len(cached) * size)

    def _make_room(self, pages: int) -> bool:
        short = pages - self.pool.free_count
        if short > 0 and self.prefix_cache:
            self.prefix_cache.evict(short)
        return pages <= self.pool.free_count

    def _run(self, batch: list[tuple[Unit, ScheduledSeq]]) -> None:
        entries = [e for _, e in batch]
        try:
            outcome = self._forward(batch, entries)
        except Exception as e:  # this batch fails; the runtime goes on
            logging.exception("forward of %d sequences failed", len(entries))
            outcome = e
        finally:  # before any request is answered: a client with its answer finds them free
            with self._cond:
                for entry in entries:
                    self.pool.release(entry.pages)
                self._running.clear()
        if isinstance(outcome, Exception):
            self._fail(batch, outcome)
        else:
            self._finish(batch, *outcome)

    def _forward(self, batch: list[tuple[Unit, ScheduledSeq]], entries: list[ScheduledSeq]):
        """The pass's label logits and logsumexp."""
        labels = [u.job.labels for u, _ in batch for _ in u.items]
        with_lse = any(u.job.with_lse for u, _ in batch)
        shape = self.buckets.shape(sum(e.new_tokens for e in entries), len(labels),
                                   len(entries))
        with jax.profiler.TraceAnnotation("build_batch"):
            forward = build_batch(entries, labels, shape, self.buckets.page_size,
                                  self.runner.num_pages, self.runner.sizes, with_lse)
        with jax.profiler.TraceAnnotation("forward"):
            logits, lse = self.runner.run(forward, shape)
        self.stats.padded_tokens += shape.tokens
        return logits, lse

    def _finish(self, batch, logits, lse) -> None:
        self.stats.forwards += 1
        row = 0
        for unit, entry in batch:
            n = len(unit.items)
            self.stats.computed_tokens += entry.new_tokens
            self.stats.cached_tokens += entry.cached
            unit.job.unit_done(unit.items, logits[row:row + n], lse[row:row + n],
                               len(unit.seq.tokens))
            row += n

    def _fail(self, batch, error: Exception) -> None:
        self.stats.failed_forwards += 1
        if self.prefix_cache:  # its pages may hold K/V never written, or the cache was rebuilt
            with self._cond:
                self.prefix_cache.clear()
        message = f"the forward pass failed: {type(error).__name__}: {error}"
        for unit, _ in batch:
            unit.job.fail(ScoreError(message, status=500))
