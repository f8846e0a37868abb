"""A small request behind a large one, under each schedule policy, without HTTP.

python -m profiling.bench_fairness [--model-path P] [--big-items 2000 --small-items 10
    --query-tokens 120 --item-tokens 18 --small-after-s 0.5 --repeats 2 --out fairness.json]

Per policy (fcfs, then fair), one engine at the server's default budgets: the large request
alone (its total time and forwards), the small one alone (median of 3), then `repeats` times
the large request submitted and the small one `small_after_s` later, while the large one's
first forward runs: the small one's latency, and the large one's total time. Each request has
its own query (seeds 0 and 1); the prefix cache is flushed before every run, and an untimed
run of the scenario compiles its shapes first.
"""
import statistics
import tempfile
import time

import jax
from absl import app, flags

from model.loader import load_config
from profiling.bench_engine import workload
from profiling.timing import write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.request import ScoreRequest
from runtime.wait_queue import SCHEDULE_POLICIES

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model to load; default: the embedded SmolLM2")
    flags.DEFINE_integer("big_items", 2000, "items of the large request")
    flags.DEFINE_integer("small_items", 10, "items of the small request")
    flags.DEFINE_integer("query_tokens", 120, "tokens in each query")
    flags.DEFINE_integer("item_tokens", 18, "tokens per item")
    flags.DEFINE_float("small_after_s", 0.5, "when the small request arrives after the large")
    flags.DEFINE_integer("repeats", 2, "timed runs of the scenario per policy")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def alone(engine: Engine, req: ScoreRequest) -> tuple[float, int]:
    """(seconds, forwards) of `req` with nothing else queued, from a cold prefix cache."""
    engine.flush_prefix_cache()
    forwards, start = engine.scheduler.stats.forwards, time.perf_counter()
    engine.submit(req).result()
    return time.perf_counter() - start, engine.scheduler.stats.forwards - forwards


def behind(engine: Engine, big: ScoreRequest, small: ScoreRequest, after_s: float):
    """(the small request's latency, the large one's total time) when the small arrives
    `after_s` after the large."""
    engine.flush_prefix_cache()
    start = time.perf_counter()
    big_future = engine.submit(big)
    time.sleep(after_s)
    small_start = time.perf_counter()
    engine.submit(small).result()
    small_s = time.perf_counter() - small_start
    big_future.result()
    return small_s, time.perf_counter() - start


def run_policy(policy: str, big: ScoreRequest, small: ScoreRequest, programs: str) -> dict:
    engine = Engine.from_path(FLAGS.model_path, EngineConfig(
        schedule_policy=policy, warmup=False, program_cache_dir=programs))
    try:
        behind(engine, big, small, FLAGS.small_after_s)  # compiles the shapes it uses
        big_s, big_forwards = alone(engine, big)
        small_alone = statistics.median(alone(engine, small)[0] for _ in range(3))
        runs = [behind(engine, big, small, FLAGS.small_after_s) for _ in range(FLAGS.repeats)]
    finally:
        engine.close()
    forward_s = big_s / big_forwards
    small_behind, big_behind = (statistics.median(x) for x in zip(*runs))
    return {"big_alone_s": big_s, "big_forwards": big_forwards, "big_forward_s": forward_s,
            "small_alone_s": small_alone, "small_behind_s": small_behind,
            "small_wait_in_forwards": (small_behind - small_alone) / forward_s,
            "big_behind_s": big_behind, "big_slowdown": big_behind / big_s,
            "runs": [{"small_s": s, "big_s": b} for s, b in runs]}


def main(argv) -> None:
    del argv
    vocab = load_config(FLAGS.model_path).vocab_size
    shape = (FLAGS.query_tokens, FLAGS.item_tokens)
    big = workload(vocab, *shape, FLAGS.big_items, 2, 1, 1, seed=0)[0]
    small = workload(vocab, *shape, FLAGS.small_items, 2, 1, 1, seed=1)[0]
    result = {"backend": jax.default_backend(), "timing": "wall clock", "policies": {}}
    with tempfile.TemporaryDirectory() as programs:  # compiled once, read back by the second
        for policy in reversed(SCHEDULE_POLICIES):
            row = run_policy(policy, big, small, programs)
            result["policies"][policy] = row
            print(f"{policy}: small alone {row['small_alone_s'] * 1e3:.0f} ms, behind the large "
                  f"one {row['small_behind_s'] * 1e3:.0f} ms (+{row['small_wait_in_forwards']:.1f}"
                  f" of its {row['big_forwards']} forwards of {row['big_forward_s'] * 1e3:.0f} "
                  f"ms); large alone {row['big_alone_s']:.1f} s, with the small "
                  f"{row['big_behind_s']:.1f} s ({row['big_slowdown']:.3f}x)", flush=True)
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
