"""The scheduler's host work per forward against a v6e chip's forward at the same bucket: a
serving loop keeps the chip busy only if the host prepares a forward in less time than the
chip runs one.

python -m profiling.bench_host_work [--buckets 128,256,512,1024,2048,4096,8192]
    [--forwards 40] [--estimate] [--estimates-from earlier.json] [--out host_work.json]

Per bucket: an engine whose budget is the bucket (the server's other defaults; one forward in
flight, since on CPU the forward runs on the same cores and would slow the host work it is
measured beside) on a tiny random Qwen3 (2 layers, hidden 64: what the host does does not
depend on the model's size), fed SGLang-shaped requests (120-token queries, items of 18
tokens, 2 labels, each request its own query) that fill one forward each. Host work: the
scheduler thread's CPU time on a forward (forming it, building its batch and attention plan,
dispatching it, reading and answering its results; time.thread_time, so waiting for the
device is not counted), the median over `forwards` forwards. Beside it, the v6e estimate (a
model, no TPU ran it: profiling.v6e.forward_estimate) of Qwen3-0.6B in bfloat16 on the same batch.
"""
import collections
import json
import os
import platform
import statistics
import tempfile

import numpy as np
from absl import app, flags, logging

from profiling.bench_forward import LABELS, fill, filled_batch
from profiling.bench_serving import TINY, tiny_checkpoint
from profiling.timing import write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.request import ScoreRequest

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("buckets", ["128", "256", "512", "1024", "2048", "4096", "8192"],
                      "forward sizes in tokens")
    flags.DEFINE_integer("forwards", 40, "forwards timed per bucket")
    flags.DEFINE_bool("estimate", True, "add Qwen3-0.6B's v6e estimate at each bucket")
    flags.DEFINE_string("estimates_from", None, "take the v6e estimates from this earlier "
                        "output (they depend on the batches, not on the host code: compiling "
                        "them takes some 25 minutes)")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def bucket_config(bucket: int, dtype: str = "float32") -> EngineConfig:
    return EngineConfig(dtype=dtype, max_prefill_tokens=bucket, max_seqs=min(64, bucket),
                        max_rows=min(256, bucket), warmup=False, pipeline_depth=1)


def forward_requests(bucket: int, vocab: int, rng) -> list[ScoreRequest]:
    """Requests of SGLang's shape that fill one forward of `bucket` tokens."""
    ec, labels = bucket_config(bucket), rng.integers(0, vocab, LABELS).tolist()
    reqs = []
    for seq in fill(bucket, ec.max_seqs, ec.max_rows, vocab, rng):
        tokens, rows = seq.tokens.tolist(), seq.score_rows.tolist()
        starts = [seq.shared_len] + [r + 1 for r in rows[:-1]]
        items = [tokens[a:r + 1] for a, r in zip(starts, rows)]
        reqs.append(ScoreRequest(tokens[:seq.shared_len], items, labels))
    return reqs


def host_seconds(engine: Engine, bucket: int, forwards: int, rng,
                 queued: int = 4) -> list[float]:
    """The scheduler's CPU seconds on each of `forwards` forwards of `bucket` tokens, with
    `queued` forwards' requests waiting or in flight at any time (as under load)."""
    vocab = TINY["vocab_size"]
    for _ in range(2):  # compiles the bucket's program
        for future in [engine.submit(r) for r in forward_requests(bucket, vocab, rng)]:
            future.result()
    done, outstanding = engine.scheduler.stats.forwards, collections.deque()
    for _ in range(forwards):
        outstanding.append([engine.submit(r) for r in forward_requests(bucket, vocab, rng)])
        if len(outstanding) == queued:
            for future in outstanding.popleft():
                future.result()
    for futures in outstanding:
        for future in futures:
            future.result()
    ran = engine.scheduler.stats.forwards - done
    return list(engine.scheduler.stats.recent_host_s)[-ran:]


def v6e_estimate_s(bucket: int, rng) -> float:
    """Qwen3-0.6B's forward of one bucket's requests, in bfloat16 on a v6e chip (a model)."""
    from profiling.v6e.forward_estimate import forward_estimate
    from profiling.v6e.compile import SIZED_MODELS
    cfg, ec = SIZED_MODELS["Qwen3-0.6B"], bucket_config(bucket, "bfloat16")
    return forward_estimate(cfg, ec, *filled_batch(ec, cfg.vocab_size, rng),
                            with_lse=True)["v6e_estimate_s"]


def run(model_path: str, buckets: list[int], forwards: int, estimate: bool,
        known_estimates: dict[int, float] | None = None) -> dict:
    """`known_estimates`: v6e estimates in ms by bucket, from an earlier run."""
    rows, known = [], known_estimates or {}
    for bucket in buckets:
        engine = Engine.from_path(model_path, bucket_config(bucket))
        try:
            host = host_seconds(engine, bucket, forwards, np.random.default_rng(bucket))
        finally:
            engine.close()
        row = {"bucket": bucket, "forwards": len(host), "host_ms_median": statistics.median(
            host) * 1e3, "host_ms_p90": float(np.percentile(host, 90)) * 1e3}
        if estimate:
            row["v6e_estimate_ms"] = known.get(bucket) or v6e_estimate_s(
                bucket, np.random.default_rng(0)) * 1e3
            row["host_over_v6e"] = row["host_ms_median"] / row["v6e_estimate_ms"]
        logging.info("bucket %d: %s", bucket, row)
        rows.append(row)
    return {"model": "tiny random Qwen3 (host work); Qwen3-0.6B bfloat16 (v6e estimate)",
            "timing": "scheduler thread CPU time per forward (time.thread_time)",
            "cpu": platform.processor() or platform.machine(), "threads": os.cpu_count(),
            "buckets": rows}


def main(argv) -> None:
    del argv
    with tempfile.TemporaryDirectory() as scratch:
        known = {}
        if FLAGS.estimates_from:
            with open(FLAGS.estimates_from) as f:
                known = {r["bucket"]: r["v6e_estimate_ms"] for r in json.load(f)["buckets"]}
        result = run(tiny_checkpoint(os.path.join(scratch, "tiny")),
                     [int(b) for b in FLAGS.buckets], FLAGS.forwards, FLAGS.estimate, known)
    print("bucket | host ms (median) | host ms (p90) | v6e estimate ms | host / v6e")
    for r in result["buckets"]:
        est = (f"{r['v6e_estimate_ms']:.3f} | {r['host_over_v6e']:.0%}"
               if "v6e_estimate_ms" in r else "- | -")
        print(f"{r['bucket']} | {r['host_ms_median']:.3f} | {r['host_ms_p90']:.3f} | {est}")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
