"""python -m server.batch --input requests.jsonl --output results.jsonl [engine flags]

Scores a file of /v1/score and /v1/rerank requests on the engine, without HTTP, in OpenAI's
batch file format (`server/batch_job.py`). Killed and started again with the same arguments,
it scores only the lines without a result. The engine's flags are the server's. With
--ray-actors N, the job's shards run on N engine actors of a Ray cluster
(`server/batch_ray.py`).
"""
import glob
import json
import os
import sys
import time

from absl import app, flags, logging

from runtime.cli_flags import parse_flags
from server import engine_flags
from server.batch_job import (
    Counts,
    ResultLog,
    jsonl_lines,
    parquet_row_count,
    parquet_rows,
    routes,
    run_job,
)
from server.batch_ray import run_ray_job, shards
from server.engine_flags import (
    define_engine_flags,
    engine_config,
    served_model_name,
    start_engine,
)

FLAGS = flags.FLAGS


def define_batch_flags() -> None:
    flags.DEFINE_string("input", None, "request lines (JSONL, OpenAI's batch format), or a "
                        ".parquet file of /v1/score rows: query, items, label_token_ids "
                        "(and custom_id, apply_softmax, item_first)")
    flags.DEFINE_string("output", None, "result lines, appended; the job's record for a "
                        "restart")
    flags.DEFINE_integer("max_in_flight", 512, "requests submitted and not answered: enough "
                         "to fill every forward")
    flags.DEFINE_integer("ray_actors", 0, "run under Ray Data on this many engine actors, one "
                         "per device group (the batch extra); --input then names JSONL files "
                         "(a glob), --output a directory of a result file per shard; 0: one "
                         "process, no Ray")
    flags.DEFINE_string("ray_address", None, "the Ray cluster to join (ray.init's address); "
                        "default: a local one, or RAY_ADDRESS")
    flags.DEFINE_integer("ray_lines_per_shard", 0, "under Ray, shards of this many lines; 0: "
                         "a shard per input file")
    flags.DEFINE_string("ray_actor_resources", "", 'under Ray, what each engine actor asks '
                        'beside a CPU, as JSON: {"TPU": 4} for a v6e host\'s 4 chips')
    flags.mark_flags_as_required(["input", "output"])


class Progress:
    """A status line on a terminal, at most every `every_s`: results, items, items/s, and
    the time the lines left would take at this run's rate."""

    def __init__(self, total: int, done_before: int, stream=sys.stderr, every_s: float = 0.5):
        self.total, self.done_before = total, done_before
        self.stream, self.every_s = stream, every_s
        self.start = self._last = time.monotonic()
        self.on = stream.isatty()

    def __call__(self, counts: Counts, final: bool = False) -> None:
        now = time.monotonic()
        if not self.on or (now - self._last < self.every_s and not final):
            return
        self._last = now
        self.stream.write("\r" + self.line(counts, now - self.start) + ("\n" if final else ""))
        self.stream.flush()

    def line(self, counts: Counts, elapsed: float) -> str:
        done = self.done_before + counts.requests
        rate = counts.requests / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else float("nan")
        return (f"{done}/{self.total} requests ({counts.failed} failed), {counts.items} items, "
                f"{counts.items / max(elapsed, 1e-9):.0f} items/s, {left:.0f} s left  ")


def count_lines(path: str) -> int:
    """Request lines in `path` (not blank), streamed."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            n += bool(raw.strip())
    return n


def run_on_ray() -> None:
    """The job's shards on a Ray cluster's engine actors (server/batch_ray.py)."""
    import ray  # the batch extra
    inputs = sorted(glob.glob(FLAGS.input))
    if not inputs:
        raise app.UsageError(f"--input {FLAGS.input}: no such files")
    try:
        resources = json.loads(FLAGS.ray_actor_resources or "{}")
    except ValueError as e:
        raise app.UsageError(f"--ray-actor-resources: {e}") from None
    os.makedirs(FLAGS.output, exist_ok=True)
    address = FLAGS.ray_address or os.environ.get("RAY_ADDRESS")
    # a local cluster: a CPU for each actor and one for Ray Data's own tasks, at least
    ray.init(address=address, **({} if address else {
        "num_cpus": max(os.cpu_count() or 1, FLAGS.ray_actors + 1)}))
    counts = run_ray_job(shards(inputs, FLAGS.output, FLAGS.ray_lines_per_shard),
                         FLAGS.model_path, engine_config(), FLAGS.ray_actors,
                         FLAGS.max_in_flight, resources, FLAGS.compile_cache_dir,
                         served_model_name())
    logging.info("%d shards: %d results written (%d failed, %d items) under %s", len(counts),
                 sum(c["requests"] for c in counts), sum(c["failed"] for c in counts),
                 sum(c["items"] for c in counts), FLAGS.output)


def run_here() -> None:
    """The job in this process, on its own engine."""
    parquet = FLAGS.input.endswith(".parquet")
    try:  # a bad path or file fails before the model loads
        total = (parquet_row_count if parquet else count_lines)(FLAGS.input)
        log = ResultLog(FLAGS.output)
    except (OSError, ValueError, ImportError) as e:
        raise app.UsageError(str(e)) from None
    with log:
        run_logged(log, total, parquet_rows if parquet else jsonl_lines)


def run_logged(log: ResultLog, total: int, read) -> None:
    """The job in this process, into `log`, on an engine of its own; `read(path, urls)`: the
    input's lines."""
    engine = start_engine()
    try:
        job_routes = routes(engine, served_model_name())
        progress = Progress(total, log.written)
        lines = read(FLAGS.input, job_routes)
        start = time.perf_counter()
        counts = run_job(lines, log, job_routes, FLAGS.max_in_flight, progress)
        seconds = time.perf_counter() - start
        progress(counts, final=True)
        logging.info("%d results written (%d failed, %d items) in %.2f s, %.1f items/s; %d "
                     "from earlier runs", counts.requests, counts.failed, counts.items, seconds,
                     counts.items / max(seconds, 1e-9), log.written - counts.requests)
    finally:
        engine.close()


def main(argv) -> None:
    del argv
    if FLAGS.nnodes > 1:
        raise app.UsageError("the batch command runs on one host (--nnodes 1); for many, "
                             "--ray-actors")
    (run_on_ray if FLAGS.ray_actors else run_here)()


if __name__ == "__main__":
    define_engine_flags()
    define_batch_flags()
    flags.adopt_module_key_flags(engine_flags)
    app.run(main, flags_parser=parse_flags)
