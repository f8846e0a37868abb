"""The server as a user starts it, against HuggingFace transformers scoring the same requests.

python -m profiling.bench_compare [--model-path P] [--dtype float32] [--shapes base,...]
    [--requests 12] [--clients 4] [--repeats 3] [--hf-per-item-shapes base] [--hf-device cuda]
    [--server-args "--max-prefill-tokens 4096"] [--out compare.json]

Needs `torch` and `transformers` (`make bench-compare` installs them). For each shape
(SGLang's benchmark shapes: the base shape, 120-token query, 10 items of 18 tokens, 2 labels,
and that shape with one of query length, item count or label count changed):
- server: `python -m server` in a subprocess, on JAX's default backend, --dtype and
  --server-args beside the default flags; `requests`
  requests, each with its own query (token ids, seed 0), sent by `clients` concurrent clients,
  each sending its next request when the last is answered, from an empty prefix cache. items/s:
  items over wall time, median of `repeats` runs; latency: one request alone, median of
  `repeats`; padding: the share of the forwards' bucket tokens that were padding (/metrics).
- HuggingFace in --dtype, on --hf-device (a CUDA GPU where torch sees one, else the CPU with
  as many threads as the server; profiling.hf_baseline): the same
  requests one after another (median of `repeats` runs), with the query's KV reused by the
  request's items, and, for --hf-per-item-shapes, one prompt per item.
Scores of the first request are compared: the max absolute difference, and that over the
largest score. The server and HuggingFace never run at the same time.
"""
import asyncio
import os
import platform
import re
import statistics
import time

import numpy as np
from absl import app, flags

from profiling.bench_engine import workload
from profiling.score_client import ConnectionPool, server_vocab
from profiling.server_process import running_server
from profiling.timing import write_json
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS
BASE = {"query_tokens": 120, "num_items": 10, "item_tokens": 18, "num_labels": 2}
SHAPES = {"base": {}, **{f"query_{n}": {"query_tokens": n} for n in (50, 200, 1000)},
          **{f"items_{n}": {"num_items": n} for n in (4, 16, 64)},
          **{f"labels_{n}": {"num_labels": n} for n in (8, 32)}}


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model to load; default: the embedded SmolLM2")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "the server's and HF's")
    flags.DEFINE_string("hf_device", None, "torch device of HuggingFace; default: cuda where "
                        "torch sees a GPU, else cpu")
    flags.DEFINE_list("shapes", list(SHAPES), f"shapes to run, of {list(SHAPES)}")
    flags.DEFINE_integer("requests", 12, "requests per throughput run, each its own query")
    flags.DEFINE_integer("clients", 4, "concurrent clients of the server")
    flags.DEFINE_integer("repeats", 3, "runs of the single-request latency")
    flags.DEFINE_list("hf_per_item_shapes", ["base"], "shapes that also run HuggingFace with "
                      "one prompt per item (slow: the query is recomputed per item)")
    flags.DEFINE_string("server_args", "", "more flags for python -m server")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def shape_requests(vocab: int, shape: dict, requests: int) -> list:
    """`requests` requests of `shape`, each with its own query, and one more for warm-up."""
    s = {**BASE, **shape}
    return workload(vocab, s["query_tokens"], s["item_tokens"], s["num_items"], s["num_labels"],
                    requests + 1, requests + 1)


async def _score(pool: ConnectionPool, req) -> list:
    body = {"query": req.query, "items": req.items, "label_token_ids": req.label_token_ids}
    return (await pool.post_json("/v1/score", body))["scores"]


async def _token_counts(pool: ConnectionPool) -> np.ndarray:
    """(computed, padded) tokens of the server's forwards so far."""
    text = (await pool.request("GET", "/metrics")).body.decode()
    return np.array([float(re.search(rf"^jax_score_{name}_tokens_total (\S+)$", text,
                                     re.MULTILINE).group(1)) for name in ("computed", "padded")])


async def _closed_loop(pool: ConnectionPool, reqs: list, clients: int) -> float:
    """Seconds for `clients` clients to have every request answered, one at a time each."""
    queue = list(reqs)

    async def client():
        while queue:
            await _score(pool, queue.pop(0))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start


async def _alone(pool: ConnectionPool, req, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        await pool.post_json("/flush_cache")
        start = time.perf_counter()
        await _score(pool, req)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def serve_shape(url: str, reqs: list, clients: int, repeats: int) -> tuple[dict, np.ndarray]:
    """The server's row for one shape's requests (from shape_requests), and its scores of the
    first request."""
    pool = ConnectionPool(url)
    await _score(pool, reqs[-1])  # compiles whatever the warm-up left
    latency = await _alone(pool, reqs[-1], repeats)
    before, times = await _token_counts(pool), []
    for _ in range(repeats):
        await pool.post_json("/flush_cache")
        times.append(await _closed_loop(pool, reqs[:-1], clients))
    computed, padded = await _token_counts(pool) - before
    seconds = statistics.median(times)
    scores = np.array(await _score(pool, reqs[0]))
    pool.close()
    items = sum(len(r.items) for r in reqs[:-1])
    return {"items_per_s": items / seconds, "latency_s": latency,
            "padding": 1 - computed / padded}, scores


def default_hf_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def run(model_path: str | None, shapes: list[str], requests: int, clients: int, repeats: int,
        hf_per_item_shapes: list[str], server_args: str = "", dtype: str = "float32",
        hf_device: str = "cpu") -> dict:
    from profiling.hf_baseline import HfScorer
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; known: {list(SHAPES)}")
    rows, ours, reqs = {}, {}, {}
    with running_server(model_path, f"--dtype {dtype} {server_args}") as served:
        url, devices, start_s = served.url, served.devices, served.start_s
        vocab = asyncio.run(server_vocab(url))
        for name in shapes:
            reqs[name] = shape_requests(vocab, SHAPES[name], requests)
            rows[name] = {"shape": {**BASE, **SHAPES[name]}}
            rows[name]["server"], ours[name] = asyncio.run(
                serve_shape(url, reqs[name], clients, repeats))
    reuse = HfScorer.from_path(model_path, reuse_query_kv=True, dtype=dtype, device=hf_device)
    for name in shapes:
        modes = [("hf_query_kv_reuse", reuse)]
        if name in hf_per_item_shapes:
            modes.append(("hf_per_item", reuse.with_reuse(False)))
        for mode, hf in modes:
            row = hf.time(reqs[name][:-1], repeats)
            diff = np.abs(hf.scores(reqs[name][0]) - ours[name]).max()
            row["max_abs_diff_vs_server"] = float(diff)
            row["max_rel_diff_vs_server"] = float(diff / np.abs(ours[name]).max())
            row["server_speedup"] = rows[name]["server"]["items_per_s"] / row["items_per_s"]
            rows[name][mode] = row
    return {"requests": requests, "clients": clients, "server_args": server_args,
            "dtype": dtype, "server_devices": devices, "server_start_s": start_s,
            "hf_device": reuse.device_name,
            "cpu": platform.processor() or platform.machine(), "threads": os.cpu_count(),
            "timing": "wall clock: the server's from its clients, HuggingFace's in process",
            "shapes": rows}


def main(argv) -> None:
    del argv
    result = run(FLAGS.model_path, FLAGS.shapes, FLAGS.requests, FLAGS.clients, FLAGS.repeats,
                 FLAGS.hf_per_item_shapes, FLAGS.server_args, FLAGS.dtype,
                 FLAGS.hf_device or default_hf_device())
    print(f"{result['requests']} requests, {result['clients']} clients, {result['dtype']}; "
          f"server on {result['server_devices']} (served {result['server_start_s']:.0f} s after "
          f"start), HF on {result['hf_device']}; items/s, latency of one request alone, and the "
          f"server's items/s over each baseline's")
    for name, row in result["shapes"].items():
        server = row["server"]
        line = (f"{name:11s} server {server['items_per_s']:7.1f} items/s "
                f"{server['latency_s'] * 1e3:7.0f} ms (padding {server['padding']:.0%})")
        for mode in ("hf_query_kv_reuse", "hf_per_item"):
            if mode in row:
                hf = row[mode]
                line += (f" | {mode} {hf['items_per_s']:6.1f} items/s "
                         f"{hf['latency_s'] * 1e3:6.0f} ms x{hf['server_speedup']:.2f} "
                         f"(diff {hf['max_abs_diff_vs_server']:.1e}, "
                         f"{hf['max_rel_diff_vs_server']:.1e} of the largest score)")
        print(line)
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
