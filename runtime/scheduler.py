"""Continuous batching: waiting units of every request share ragged forwards (CONTRACT §4-§5),
pipelined so that the host prepares the next forward while the devices run this one.

One thread owns the page pool, the prefix cache and the device. It takes waiting units in the
order of its `WaitQueue` (fair or first come, first served) until the next would break a
budget (tokens, sequences, rows, pages), so no unit is overtaken within that order. A unit
reuses the cached pages of its query; pages it computes are cached when the batch is formed,
so units behind it, in the same forward or a later one, share them too (every layer writes
all new K/V before any token attends, and forwards run on the device in the order they were
dispatched, each on the KV pool the one before gave back).

Pipeline (like SGLang's overlap scheduler): up to `depth` forwards are in flight. While
forward N runs, the thread forms, builds and dispatches forward N+1, then waits for N's
results and answers them. A forward's pages return to the pool when its results are in. A
forward that fails fails its own requests; forwards dispatched behind it ran on what it left
in the pool, so their units go back to the head of the queue and run again.
"""
import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
from absl import logging

from runtime.batch_builder import ScheduledSeq, build_batch
from runtime.buckets import BatchShape, ShapeBuckets, pages_needed
from runtime.errors import ScoreError
from runtime.job import Job, Unit, forward_scores
from runtime.model_runner import ModelRunner, Pending
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
    in_flight_s: float = 0.0  # wall time with at least one forward dispatched and not collected
    host_s: float = 0.0       # the scheduler thread's CPU time: forming, building,
    #                           dispatching forwards and answering their results
    recent_host_s: collections.deque = dataclasses.field(  # per forward, the latest
        default_factory=lambda: collections.deque(maxlen=4096))


@dataclasses.dataclass(frozen=True)
class ReplicaStatus:
    """What a replica reports of itself, in the engine's process or its own: its counters
    (SchedulerStats'), its queue, its KV pool, its programs and its devices."""
    forwards: int
    failed_forwards: int
    computed_tokens: int
    padded_tokens: int
    cached_tokens: int
    in_flight_s: float
    host_s: float
    waiting: int           # units queued for a forward
    kv_pages: int
    kv_pages_free: int
    page_size: int
    compilations: int
    backend: str           # the kernels'
    devices: int
    platform: str
    device_kind: str


@dataclasses.dataclass(eq=False)
class _Forward:
    batch: list[tuple[Unit, ScheduledSeq]]
    shape: BatchShape | None = None
    pending: Pending | None = None  # set once dispatched
    host_s: float = 0.0             # the scheduler thread's CPU time on it so far

    @property
    def entries(self) -> list[ScheduledSeq]:
        return [e for _, e in self.batch]


class Scheduler:
    down = ""  # why it takes no work: never, in this process (replica_process's may be down)

    def __init__(self, runner: ModelRunner, prefix_cache: bool = True, policy: str = "fair",
                 depth: int = 2, answered: Callable[[], None] = lambda: None):
        """`depth`: forwards in flight at once; 1 runs them one after another. `answered`:
        called on the scheduler's thread once a forward's units are answered (an engine
        process sends their results then, a message a front end)."""
        if depth < 1:
            raise ValueError(f"the pipeline depth must be at least 1, got {depth}")
        self.runner, self.depth, self._answered = runner, depth, answered
        self.buckets: ShapeBuckets = runner.buckets
        self.pool = PagePool(runner.num_pages)
        self.prefix_cache = PrefixCache(self.pool, self.buckets.page_size) if prefix_cache else None
        self.stats = SchedulerStats()
        self._waiting = WaitQueue(policy)
        self._in_flight: collections.deque[_Forward] = collections.deque()  # oldest first
        self._busy_since = 0.0
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
        """Stops taking work: forwards in flight are answered, waiting requests fail (503)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def load(self) -> int:
        """Tokens queued or in forwards in flight: the work a new request waits behind."""
        with self._cond:
            return (sum(len(u.seq.tokens) for u in self._waiting)
                    + sum(e.new_tokens for f in self._in_flight for e in f.entries))

    def status(self) -> ReplicaStatus:
        st, runner = self.stats, self.runner
        with self._cond:
            waiting, free = len(self._waiting), self.pool.free_count
        counters = {f.name: getattr(st, f.name) for f in dataclasses.fields(ReplicaStatus)
                    if hasattr(st, f.name)}  # SchedulerStats' own, by name
        return ReplicaStatus(
            **counters, waiting=waiting, kv_pages=self.pool.num_pages, kv_pages_free=free,
            page_size=self.buckets.page_size, compilations=runner.compile_count,
            backend=runner.backend, devices=len(runner.devices),
            platform=runner.devices[0].platform, device_kind=runner.devices[0].device_kind)

    def check_pages(self) -> None:
        """The page invariant: counts equal holders (sequences in flight and the cache)."""
        with self._cond:
            holders = [e.pages for f in self._in_flight for e in f.entries]
            self.pool.check(holders + ([self.prefix_cache.pages()] if self.prefix_cache else []))

    def flush_prefix_cache(self) -> int:
        """Drops every cached prefix nobody is using; returns the pages freed."""
        with self._cond:
            return self.prefix_cache.evict(self.pool.num_pages) if self.prefix_cache else 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._in_flight and not self._closed:
                    self._cond.wait()
                if self._closed and not self._in_flight:
                    break
                forward, start = None, time.thread_time()
                if self._waiting and not self._closed and len(self._in_flight) < self.depth:
                    with jax.profiler.TraceAnnotation("form_batch"):
                        forward = self._form_forward()
            if forward is not None:
                self._dispatch(forward)
                forward.host_s += time.thread_time() - start
                if len(self._in_flight) < self.depth and not self._closed:
                    continue  # room for one more: prepare it while these run
            if self._in_flight:
                self._complete()
        with self._cond:
            for unit in self._waiting:
                unit.job.fail(ScoreError("the server is shutting down", status=503))

    def _form_forward(self) -> _Forward | None:
        """The next forward's units, their pages held, counted as in flight; None if none."""
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
                entry = self._reserve(unit.seq, self.buckets.token_budget - tokens)
            if entry is None:
                if not batch and not self._in_flight:  # cannot happen with a pool sized by
                    self._waiting.drop(unit.job)       # EngineConfig
                    unit.job.fail(ScoreError("the KV cache cannot hold this request", 500))
                    continue
                break
            self._waiting.take(unit)
            batch.append((unit, entry))
            tokens = tokens + self.buckets.padded_tokens(entry.new_tokens)
            rows += n_rows
        self._waiting.forward_formed()
        if not batch:
            return None
        forward = _Forward(batch)
        if not self._in_flight:
            self._busy_since = time.perf_counter()
        self._in_flight.append(forward)
        return forward

    def _reserve(self, seq, token_budget: int) -> ScheduledSeq | None:
        """Pages for `seq` (cached prefix + new), or None if the budgets cannot take it (its
        new tokens padded as the batch pads them)."""
        size, shareable = self.buckets.page_size, seq.cacheable
        reusable = min(seq.first_row, shareable) // size
        cached = self.prefix_cache.match(seq.tokens, reusable) if self.prefix_cache else []
        new = pages_needed(len(seq.tokens), size) - len(cached)
        padded = self.buckets.padded_tokens(len(seq.tokens) - len(cached) * size)
        if padded > token_budget or not self._make_room(new):
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

    def _dispatch(self, forward: _Forward) -> None:
        """Builds the forward and starts it on the devices; if that fails, so do its requests."""
        labels = [u.job.labels for u, _ in forward.batch for _ in u.items]
        entries = forward.entries
        try:
            forward.shape = self.buckets.shape_of((e.new_tokens for e in entries),
                                                  len(labels), len(entries))
            with jax.profiler.TraceAnnotation("build_batch"):
                batch = build_batch(entries, labels, forward.shape, self.buckets.page_size,
                                    any(u.job.with_lse for u, _ in forward.batch),
                                    page_aligned=self.buckets.page_aligned)
            with jax.profiler.TraceAnnotation("dispatch"):
                forward.pending = self.runner.dispatch(batch, forward.shape)
        except Exception as e:  # this forward fails; the runtime goes on
            logging.exception("forward of %d sequences failed", len(entries))
            self._retire(forward)
            self._fail(forward, e)

    def _complete(self) -> None:
        """Waits for the oldest forward in flight and answers its requests."""
        forward, start = self._in_flight[0], time.thread_time()  # waiting takes no CPU time
        try:
            with jax.profiler.TraceAnnotation("collect"):
                logits, lse = self.runner.collect(forward.pending)
        except Exception as e:
            logging.exception("forward of %d sequences failed", len(forward.batch))
            self._requeue_behind(forward)
            self.runner.reset_cache()
            self._retire(forward)
            self._fail(forward, e)
            return
        self._retire(forward)  # before any answer: a client with its answer finds them free
        forward.host_s += time.thread_time() - start
        self._finish(forward, logits, lse)

    def _retire(self, forward: _Forward) -> None:
        """Returns a forward's pages to the pool: no forward in flight reads them any more."""
        with self._cond:
            self._in_flight.remove(forward)
            for entry in forward.entries:
                self.pool.release(entry.pages)
            if not self._in_flight:
                self.stats.in_flight_s += time.perf_counter() - self._busy_since

    def _requeue_behind(self, failed: _Forward) -> None:
        """Forwards dispatched after `failed` read the pool it left: once they are done, their
        units go back to the head of the queue, to run again."""
        behind = list(self._in_flight)[self._in_flight.index(failed) + 1:]
        for forward in behind:
            try:
                self.runner.collect(forward.pending)
            except Exception:  # expected: the fault passes down the pool
                pass
            self._retire(forward)
        with self._cond:
            self._waiting.put_back([u for f in behind for u, _ in f.batch if u.job.active])

    def _finish(self, forward: _Forward, logits, lse) -> None:
        """Counts the forward with its host time so far (a reader of the counters never sees
        one move without the other), then answers its requests and adds that time."""
        start = time.thread_time()
        self.stats.forwards += 1
        self.stats.host_s += forward.host_s
        self.stats.padded_tokens += forward.shape.tokens
        scores = forward_scores(logits, lse, [(u.job.kind, len(u.job.labels), len(u.items))
                                              for u, _ in forward.batch])
        for (unit, entry), unit_scores in zip(forward.batch, scores):
            self.stats.computed_tokens += entry.new_tokens
            self.stats.cached_tokens += entry.cached
            unit.job.unit_done(unit.items, unit_scores, len(unit.seq.tokens))
        self._answered()
        answering = time.thread_time() - start
        forward.host_s += answering
        self.stats.host_s += answering
        self.stats.recent_host_s.append(forward.host_s)

    def _fail(self, forward: _Forward, error: Exception) -> None:
        self.stats.failed_forwards += 1
        if self.prefix_cache:  # its pages may hold K/V never written, or the cache was rebuilt
            with self._cond:
                self.prefix_cache.clear()
        message = f"the forward pass failed: {type(error).__name__}: {error}"
        for unit, _ in forward.batch:
            unit.job.fail(ScoreError(message, status=500))
