"""The batch command against the server it stands beside: the same requests, SGLang's base
shape with every request its own query, scored by `python -m server.batch`, by the server
under `clients` concurrent clients, and (at the default engine flags) by the engine alone in
this process, in turn, on the same checkpoint and engine flags.

python -m profiling.bench_batch [--model-path DIR] [--requests 2000] [--clients 64]
    [--rounds 3] [--engine-args ""] [--out batch.json]

Without --model-path it writes the host-path benchmark's tiny checkpoint (2 layers, hidden
64: profiling.bench_serving), whose forwards take milliseconds, so the host side is what is
measured. Items/s: the server's from the first request sent to the last answer read (client
wall clock, after a warm-up pass over other requests), the batch command's from its own log
(the job alone, after the engine's start and compile); the median of the rounds.
"""
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from profiling.bench_serving import SHAPE, Bodies, tiny_checkpoint
from profiling.score_client import ConnectionPool, server_vocab
from profiling.server_process import running_server
from profiling.timing import write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.request import parse_score_request

FLAGS = flags.FLAGS
_JOB = re.compile(r"(\d+) results written \((\d+) failed, (\d+) items\) in ([\d.]+) s")


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "checkpoint; default: the tiny random Qwen3")
    flags.DEFINE_integer("requests", 2000, "requests, each with its own query")
    flags.DEFINE_integer("clients", 64, "the server's concurrent clients (closed loop)")
    flags.DEFINE_integer("rounds", 3, "server and batch command in turn, this many times")
    flags.DEFINE_string("engine_args", "", "more engine flags for both")
    flags.DEFINE_string("out", None, "write the results as JSON here")


async def _send_all(url: str, bodies: list[bytes], clients: int) -> float:
    """Seconds for `clients` closed-loop clients to have every body answered (200 each)."""
    pool, queue = ConnectionPool(url), list(reversed(bodies))

    async def client():
        while queue:
            answer = await pool.request("POST", "/v1/score", queue.pop())
            if answer.status != 200:
                raise RuntimeError(f"the server answered {answer.status}: {answer.body[:200]}")

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    pool.close()
    return seconds


def server_items_per_s(model_path: str, bodies: list[bytes], warm: list[bytes], clients: int,
                       engine_args: str) -> float:
    with running_server(model_path, engine_args) as served:
        asyncio.run(_send_all(served.url, warm, clients))
        seconds = asyncio.run(_send_all(served.url, bodies, clients))
    return len(bodies) * SHAPE["num_items"] / seconds


def batch_items_per_s(model_path: str, bodies: list[bytes], engine_args: str,
                      directory: str) -> float:
    src, out = os.path.join(directory, "in.jsonl"), os.path.join(directory, "out.jsonl")
    with open(src, "w") as f:
        for k, body in enumerate(bodies):
            f.write(json.dumps({"custom_id": str(k), "method": "POST", "url": "/v1/score",
                                "body": json.loads(body)}) + "\n")
    if os.path.exists(out):
        os.remove(out)
    done = subprocess.run([sys.executable, "-m", "server.batch", "--model-path", model_path,
                           "--input", src, "--output", out, *engine_args.split()],
                          capture_output=True, text=True, check=False)
    job = _JOB.search(done.stderr)
    if done.returncode or job is None or int(job.group(2)):
        raise RuntimeError(f"the batch command failed:\n{done.stderr[-3000:]}")
    return int(job.group(3)) / float(job.group(4))


def engine_items_per_s(model_path: str, bodies: list[bytes], warm: list[bytes]) -> float:
    """The engine's own ceiling, in a process of its own (a JAX runtime left in this one, the
    clients', slowed the server after it by a tenth): every request parsed first, then all
    submitted at once, at the default engine flags."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_engine_alone, model_path, bodies, warm).result()


def _engine_alone(model_path: str, bodies: list[bytes], warm: list[bytes]) -> float:
    engine = Engine.from_path(model_path, EngineConfig())
    try:
        concurrent.futures.wait([engine.submit(parse_score_request(json.loads(b)))
                                 for b in warm])
        requests = [parse_score_request(json.loads(b)) for b in bodies]
        start = time.perf_counter()
        concurrent.futures.wait([engine.submit(r) for r in requests])
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return len(bodies) * SHAPE["num_items"] / seconds


def run(model_path: str, requests: int, clients: int, rounds: int, engine_args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with running_server(model_path, engine_args) as served:
            vocab = asyncio.run(server_vocab(served.url))
        made = Bodies(vocab, seed=0, count=2 * requests)
        bodies = [made.next() for _ in range(requests)]
        warm = [made.next() for _ in range(requests)]
        rows = []
        for _ in range(rounds):
            rows.append({"server": server_items_per_s(model_path, bodies, warm, clients,
                                                      engine_args),
                         "batch": batch_items_per_s(model_path, bodies, engine_args, tmp),
                         **({} if engine_args else {
                             "engine": engine_items_per_s(model_path, bodies, warm)})})
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"shape": {**SHAPE, "distinct_queries": True}, "requests": requests,
            "clients": clients, "engine_args": engine_args, "rounds": rows,
            **{f"{k}_items_per_s": v for k, v in medians.items()},
            "batch_over_server": medians["batch"] / medians["server"],
            "timing": "medians of the rounds; server: client wall clock, batch: the job's own "
            "time, engine: in this process, the requests parsed first"}


def main(argv) -> None:
    del argv
    with tempfile.TemporaryDirectory() as tmp:
        model_path = FLAGS.model_path or tiny_checkpoint(os.path.join(tmp, "tiny"))
        result = run(model_path, FLAGS.requests, FLAGS.clients, FLAGS.rounds,
                     FLAGS.engine_args)
    for k, row in enumerate(result["rounds"]):
        print(f"round {k}: " + ", ".join(f"{name} {v:.0f} items/s" for name, v in row.items()))
    print(f"median: server {result['server_items_per_s']:.0f}, batch "
          f"{result['batch_items_per_s']:.0f} items/s ({result['batch_over_server']:.2f}x); "
          f"the engine alone {result.get('engine_items_per_s', float('nan')):.0f}")
    write_json({**result, "model_path": FLAGS.model_path or "tiny"}, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
