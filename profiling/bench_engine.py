"""Offline scoring throughput and latency of the engine, without HTTP.

python -m profiling.bench_engine [--model-path P] [--query-tokens 120 --item-tokens 18
    --num-items 10 --num-labels 2 --requests 16 --distinct-queries 4 --repeats 3
    --compare-hf --trace-dir D --out results.json]

Workload: `requests` requests of `num_items` items each; their queries cycle through
`distinct_queries` different queries (a shelf scored over several requests). Modes:
multi-item or one prompt per item, with the prefix cache on or off; with --compare-hf (needs
`transformers` and `torch`), HuggingFace transformers scoring the same requests, one prompt
per item and with the query's KV reused by the items (profiling.hf_baseline).
- items/s: every request submitted at once, items over wall time until the last result.
- latency: one request alone, median of `repeats`.
Token ids from seed 0. The prefix cache is flushed before every timed run; compilation happens
in an untimed run.
"""
import os
import platform
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from profiling.timing import subdir, tracing, write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.request import ScoreRequest

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model to load; default: the embedded SmolLM2")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and activations")
    flags.DEFINE_integer("query_tokens", 120, "tokens in each query")
    flags.DEFINE_integer("item_tokens", 18, "tokens per item")
    flags.DEFINE_integer("num_items", 10, "items per request")
    flags.DEFINE_integer("num_labels", 2, "label token ids per request")
    flags.DEFINE_integer("requests", 16, "requests per throughput run")
    flags.DEFINE_integer("distinct_queries", 4, "different queries among the requests")
    flags.DEFINE_integer("repeats", 3, "timed runs per mode")
    flags.DEFINE_integer("max_prefill_tokens", 2048, "the engine's batch budget")
    flags.DEFINE_bool("compare_hf", False, "also time HuggingFace transformers (CPU, float32)")
    flags.DEFINE_string("trace_dir", None, "write a jax.profiler trace of each mode here")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def workload(vocab: int, query_tokens: int, item_tokens: int, num_items: int, num_labels: int,
             requests: int, distinct_queries: int, seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    queries = [rng.integers(0, vocab, query_tokens).tolist() for _ in range(distinct_queries)]
    labels = rng.integers(0, vocab, num_labels).tolist()
    return [ScoreRequest(queries[r % distinct_queries],
                         [rng.integers(0, vocab, item_tokens).tolist() for _ in range(num_items)],
                         labels) for r in range(requests)]


def per_item(reqs: list[ScoreRequest]) -> list[ScoreRequest]:
    return [ScoreRequest(r.query, [item], r.label_token_ids) for r in reqs for item in r.items]


def _wall(engine: Engine, reqs: list[ScoreRequest]) -> float:
    """Seconds from submitting every request at once to the last result, from a cold cache."""
    engine.flush_prefix_cache()
    start = time.perf_counter()
    for future in [engine.submit(r) for r in reqs]:
        future.result()
    return time.perf_counter() - start


def time_mode(engine: Engine, reqs: list[ScoreRequest], first: list[ScoreRequest],
              items: int, repeats: int, trace_dir: str | None = None) -> dict:
    """`first`: the requests making up the first request of `reqs` (for the latency);
    `trace_dir`: where the throughput runs are traced."""
    _wall(engine, reqs)  # compiles the shapes this mode uses
    with tracing(trace_dir):
        total = statistics.median([_wall(engine, reqs) for _ in range(repeats)])
    latency = statistics.median(_wall(engine, first) for _ in range(repeats))
    return {"items_per_s": items / total, "latency_s": latency}


def run(engines: dict[bool, Engine], reqs: list[ScoreRequest], repeats: int,
        hf=None, trace_dir: str | None = None) -> dict:
    """`engines`: prefix cache on (True) and off (False); `hf`: an HfScorer or None."""
    items = sum(len(r.items) for r in reqs)
    rows = {}
    for prefix, engine in engines.items():
        tag = "prefix_on" if prefix else "prefix_off"
        rows[f"multi_item/{tag}"] = time_mode(engine, reqs, reqs[:1], items, repeats,
                                              subdir(trace_dir, f"multi_item_{tag}"))
        rows[f"prompt_per_item/{tag}"] = time_mode(
            engine, per_item(reqs), per_item(reqs[:1]), items, repeats,
            subdir(trace_dir, f"prompt_per_item_{tag}"))
    if hf is not None:
        ours = np.array(engines[True].score_request(reqs[0]).scores)
        for mode, scorer in (("prompt_per_item", hf), ("query_kv_reuse", hf.with_reuse(True))):
            row = scorer.time(reqs, repeats)
            row["max_abs_diff_vs_ours"] = float(np.abs(scorer.scores(reqs[0]) - ours).max())
            rows[f"hf_transformers/{mode}"] = row
    first = reqs[0]
    return {"shape": dict(query_tokens=len(first.query), item_tokens=len(first.items[0]),
                          num_items=len(first.items), num_labels=len(first.label_token_ids),
                          requests=len(reqs)),
            "backend": jax.default_backend(), "cpu": platform.processor() or platform.machine(),
            "threads": os.cpu_count(), "timing": "wall clock, median of repeats", "modes": rows,
            "traced": trace_dir}


def main(argv) -> None:
    del argv
    engines = {prefix: Engine.from_path(FLAGS.model_path, EngineConfig(
        dtype=FLAGS.dtype, max_prefill_tokens=FLAGS.max_prefill_tokens, prefix_cache=prefix,
        warmup=False)) for prefix in (True, False)}
    reqs = workload(engines[True].cfg.vocab_size, FLAGS.query_tokens, FLAGS.item_tokens,
                    FLAGS.num_items, FLAGS.num_labels, FLAGS.requests, FLAGS.distinct_queries)
    hf = None
    if FLAGS.compare_hf:
        from profiling.hf_baseline import HfScorer
        hf = HfScorer.from_path(FLAGS.model_path)
    result = run(engines, reqs, FLAGS.repeats, hf, FLAGS.trace_dir)
    for name, row in result["modes"].items():
        print(f"{name:34s} {row['items_per_s']:8.1f} items/s {row['latency_s'] * 1e3:9.1f} ms")
    write_json(result, FLAGS.out)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
