"""Offline scoring throughput of the engine: multi-item packing vs one prompt per item.

python -m profiling.bench_engine [--model-path P] [--query-tokens 120 --item-tokens 18
    --num-items 10 --num-labels 2 --repeats 5 --out results.json]
Timing: wall clock after the scores reach the host (the engine returns Python floats),
after one warm-up call per mode that compiles its shapes.
"""
import platform

import jax
import numpy as np
from absl import app, flags

from profiling.timing import wall_time, write_json
from runtime.engine import Engine, EngineConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model to load; default: the embedded SmolLM2")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and activations")
    flags.DEFINE_integer("query_tokens", 120, "tokens in the shared query")
    flags.DEFINE_integer("item_tokens", 18, "tokens per item")
    flags.DEFINE_integer("num_items", 10, "items per request")
    flags.DEFINE_integer("num_labels", 2, "label token ids per request")
    flags.DEFINE_integer("repeats", 5, "timed calls per mode")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def run(engine: Engine, query_tokens: int, item_tokens: int, num_items: int, num_labels: int,
        repeats: int) -> dict:
    rng = np.random.default_rng(0)
    vocab = engine.cfg.vocab_size
    query = rng.integers(0, vocab, query_tokens).tolist()
    items = [rng.integers(0, vocab, item_tokens).tolist() for _ in range(num_items)]
    labels = rng.integers(0, vocab, num_labels).tolist()
    modes = {
        "multi_item": lambda: engine.score(query, items, labels),
        "prompt_per_item": lambda: [engine.score(query, [it], labels) for it in items],
    }
    rows = {}
    for name, fn in modes.items():
        median = wall_time(fn, repeats=repeats)
        rows[name] = {"latency_s": median, "items_per_s": num_items / median}
    return {"shape": dict(query_tokens=query_tokens, item_tokens=item_tokens,
                          num_items=num_items, num_labels=num_labels),
            "backend": jax.default_backend(), "cpu": platform.processor() or platform.machine(),
            "timing": "wall clock, median of repeats", "modes": rows}


def main(argv) -> None:
    del argv
    engine = Engine.from_path(FLAGS.model_path, EngineConfig(dtype=FLAGS.dtype))
    result = run(engine, FLAGS.query_tokens, FLAGS.item_tokens, FLAGS.num_items,
                 FLAGS.num_labels, FLAGS.repeats)
    for name, row in result["modes"].items():
        print(f"{name:16s} {row['latency_s'] * 1e3:9.1f} ms/request "
              f"{row['items_per_s']:9.1f} items/s")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
