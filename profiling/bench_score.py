"""End-to-end load on a running server's /v1/score, in the manner of SGLang's bench_score.py.

python -m profiling.bench_score --url http://127.0.0.1:30000 --qps 4 --duration 30
    --num-items 10 --query-tokens 120 --item-tokens 18 --num-labels 2
    [--concurrency 0] [--distinct-queries 0] [--seed 0] [--profile] [--out bench_score.json]

Requests arrive as a Poisson process at `qps` for `duration` seconds. Each is token ids drawn
from the server's vocabulary (GET /get_model_info); `distinct_queries` > 0 makes queries repeat
(a shelf scored over several requests, which the prefix cache serves). `concurrency` > 0 caps
the requests in flight; a request over the cap waits, and its wait counts in its latency.
Timing: wall clock on the client, from a request's arrival time to the end of its answer.
--profile has the server trace the run (POST /start_profile, /stop_profile) into its own
--trace-dir; the result names that directory.
"""
import asyncio
import collections
import contextlib
import platform
import time

import numpy as np
from absl import app, flags

from profiling.bench_engine import workload
from profiling.score_client import ConnectionPool
from profiling.timing import write_json
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("url", "http://127.0.0.1:30000", "the server")
    flags.DEFINE_float("qps", 4.0, "mean request arrivals per second")
    flags.DEFINE_float("duration", 30.0, "seconds of arrivals")
    flags.DEFINE_integer("num_items", 10, "items per request")
    flags.DEFINE_integer("query_tokens", 120, "tokens in each query")
    flags.DEFINE_integer("item_tokens", 18, "tokens per item")
    flags.DEFINE_integer("num_labels", 2, "label token ids per request")
    flags.DEFINE_integer("concurrency", 0, "most requests in flight; 0: no cap")
    flags.DEFINE_integer("distinct_queries", 0, "different queries; 0: each request its own")
    flags.DEFINE_integer("seed", 0, "seed of arrivals and tokens")
    flags.DEFINE_bool("profile", False, "have the server write a jax.profiler trace of the run")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def arrival_times(qps: float, duration: float, rng: np.random.Generator) -> list[float]:
    """Seconds from the start of a Poisson process at `qps`, up to `duration`."""
    times, t = [], rng.exponential(1 / qps)
    while t < duration:
        times.append(t)
        t += rng.exponential(1 / qps)
    return times


def summary(latencies: list[float], statuses: list[int], num_items: int,
            elapsed: float) -> dict:
    ok = [lat for lat, status in zip(latencies, statuses) if status == 200]
    errors = collections.Counter(str(s) for s in statuses if s != 200)
    pct = np.percentile(ok, [50, 90, 99]).tolist() if ok else [None] * 3
    return {"requests": len(statuses), "ok": len(ok), "errors": sum(errors.values()),
            "error_statuses": dict(errors), "elapsed_s": elapsed,
            "req_per_s": len(ok) / elapsed, "items_per_s": len(ok) * num_items / elapsed,
            "latency_s": dict(zip(("p50", "p90", "p99"), pct),
                              mean=float(np.mean(ok)) if ok else None,
                              max=max(ok) if ok else None)}


async def run(url: str, qps: float, duration: float, num_items: int, query_tokens: int,
              item_tokens: int, num_labels: int, concurrency: int = 0,
              distinct_queries: int = 0, seed: int = 0, profile: bool = False) -> dict:
    if qps <= 0 or duration <= 0 or min(num_items, query_tokens, num_labels) < 1:
        raise ValueError("qps, duration, num_items, query_tokens and num_labels must be positive")
    pool = ConnectionPool(url)
    info = await pool.get_json("/get_model_info")
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(qps, duration, rng)
    reqs = workload(info["vocab_size"], query_tokens, item_tokens, num_items, num_labels,
                    len(arrivals), distinct_queries or len(arrivals) or 1, seed)
    gate = asyncio.Semaphore(concurrency) if concurrency > 0 else contextlib.nullcontext()
    trace_dir = (await pool.post_json("/start_profile"))["trace_dir"] if profile else None
    start = time.perf_counter()

    async def one(arrival: float, req) -> tuple[float, int]:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        body = {"query": req.query, "items": req.items, "label_token_ids": req.label_token_ids}
        async with gate:
            answer = await pool.request("POST", "/v1/score", body)
        return time.perf_counter() - start - arrival, answer.status

    results = await asyncio.gather(*(one(a, r) for a, r in zip(arrivals, reqs)))
    elapsed = time.perf_counter() - start
    if profile:
        await pool.post_json("/stop_profile")
    pool.close()
    latencies, statuses = zip(*results) if results else ((), ())
    return {"shape": dict(qps=qps, duration_s=duration, num_items=num_items,
                          query_tokens=query_tokens, item_tokens=item_tokens,
                          num_labels=num_labels, concurrency=concurrency,
                          distinct_queries=distinct_queries, seed=seed),
            "server": {k: info.get(k) for k in ("model_path", "dtype", "kernel_backend")},
            "client_cpu": platform.processor() or platform.machine(),
            "timing": "client wall clock, arrival to answer", "server_trace_dir": trace_dir,
            **summary(list(latencies), list(statuses), num_items, elapsed)}


def main(argv) -> None:
    del argv
    result = asyncio.run(run(FLAGS.url, FLAGS.qps, FLAGS.duration, FLAGS.num_items,
                             FLAGS.query_tokens, FLAGS.item_tokens, FLAGS.num_labels,
                             FLAGS.concurrency, FLAGS.distinct_queries, FLAGS.seed,
                             FLAGS.profile))
    lat = {k: f"{v * 1e3:.0f}" if v is not None else "-" for k, v in result["latency_s"].items()}
    print(f"{result['ok']}/{result['requests']} ok, {result['errors']} errors; "
          f"{result['req_per_s']:.2f} req/s, {result['items_per_s']:.1f} items/s; latency ms "
          f"p50 {lat['p50']} p90 {lat['p90']} p99 {lat['p99']}")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
