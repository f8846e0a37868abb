"""The whole host path under load: the server, started as a user starts it, on a tiny random
model whose forwards take milliseconds (as a chip's do), and SGLang's base shape sent from
this process, closed loop, at rising concurrency.

python -m profiling.bench_serving [--model-path DIR] [--server-roots .,/tmp/old]
    [--concurrency 1,4,16,64] [--duration 20] [--warmup 3] [--text] [--shelf 0] [--window 0]
    [--chip Qwen3-0.6B --chips 1] [--embedded_tokenizer] [--server-args ""] [--out serving.json]

Without --model-path it writes the tiny checkpoint (2 layers, hidden 64, Qwen3,
profiling.random_checkpoint), with a toy tokenizer of 320 tokens or, --embedded_tokenizer,
the embedded SmolLM2's (49,152). Each of --server-roots is a checkout whose `python -m server`
runs in turn (e.g. the code before a change, checked out with `git worktree add`), on the
same model and client, with --noaccess_log unless --server-args says --access_log (a
server's default: some 0.03-0.05 ms of CPU a request, docs/host_path.md). Requests: a
120-token query, 10 items of 18 tokens, 2 labels, every request its own query (the prefix
cache fills and evicts), as token ids or, with --text, as text the server tokenizes; with
--shelf N, each request's items are drawn from a shelf of N (as a catalogue scored against
many queries), else every item is its own. Each of `concurrency` clients sends its next
request when the last is answered, for `duration` seconds after `warmup` seconds of the same.
Per level: items/s and requests/s (answered within the run), latency p50/p99 (client wall
clock, request sent to answer read), the server's CPU ms per request (/proc, all its
threads: HTTP, JSON, tokenizing, scheduling and the CPU forward), its scheduler's CPU ms per
forward, requests per forward, the share of wall time a forward was in flight, and of the
texts found tokenized before (/metrics; servers from before these metrics report null).
--window N: items/s in each N-second window. --chip MODEL: the server's forwards on
simulated v6e chips instead (profiling.simulated_chip: each held for MODEL's v6e estimate of
its bucket, no CPU used), --chips of them, one a replica (--dp-size), and each chip's busy
share of the wall time reported.
"""
import asyncio
import itertools
import json
import os
import platform
import re
import statistics
import tempfile
import time

import numpy as np
from absl import app, flags

from model.loader import load_front
from model.tokenizer import TextTokenizer
from profiling import random_checkpoint
from profiling.random_checkpoint import SPECIAL_TOKENS
from profiling.simulated_chip import ChipLog
from profiling.score_client import ConnectionPool, server_vocab
from profiling.server_process import running_server
from profiling.timing import write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from server.http import Limits, ReadDeadlines, encode_response, read_request
from server.json_codec import parse_score_body

FLAGS = flags.FLAGS
SHAPE = {"query_tokens": 120, "num_items": 10, "item_tokens": 18, "num_labels": 2}
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}
_COUNTERS = {"forwards": "jax_score_forwards_total",
             "in_flight_s": "jax_score_forward_in_flight_seconds_total",
             "host_s": "jax_score_scheduler_host_seconds_total",
             "tokenized_texts": "jax_score_tokenized_texts_total",
             "cached_texts": "jax_score_cached_texts_total"}


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "checkpoint; default: a tiny random Qwen3")
    flags.DEFINE_list("server_roots", ["."], "checkouts whose servers run in turn")
    flags.DEFINE_list("concurrency", ["1", "4", "16", "64"], "clients, one level each")
    flags.DEFINE_float("duration", 20.0, "seconds measured per level")
    flags.DEFINE_float("warmup", 3.0, "seconds of load before each level's measurement")
    flags.DEFINE_bool("text", False, "text queries and items, tokenized by the server")
    flags.DEFINE_bool("embedded_tokenizer", False, "the default checkpoint with the embedded "
                      "SmolLM2's tokenizer (49,152 tokens) instead of the toy one")
    flags.DEFINE_integer("shelf", 0, "items drawn from a shelf of this many; 0: every item "
                         "its own")
    flags.DEFINE_float("window", 0.0, "also items/s per window of this many seconds; 0: none")
    flags.DEFINE_string("chip", "", "simulated v6e chips holding this model's forward times "
                        "(profiling/v6e/data/forward_times.json); \"\": the real forwards")
    flags.DEFINE_integer("chips", 1, "simulated chips, one a replica")
    flags.DEFINE_string("server_args", "", "more flags for every server")
    flags.DEFINE_integer("seed", 0, "seed of the requests' tokens")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def tiny_checkpoint(directory: str, embedded_tokenizer: bool = False) -> str:
    """The tiny random Qwen3; with `embedded_tokenizer`, the embedded SmolLM2's tokenizer (a
    real byte-level BPE of 49,152 tokens) and a vocabulary of its size instead of the toy
    tokenizer of 320: what tokenizing costs with a real vocabulary."""
    if not embedded_tokenizer:
        return random_checkpoint.write_checkpoint(directory, TINY, seed=0)
    tokenizer = load_front(None)[1]
    path = random_checkpoint.write_checkpoint(
        directory, {**TINY, "vocab_size": tokenizer.vocab_size}, seed=0)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path


class Bodies:
    """Request bodies of SGLang's base shape, each with its own query, as bytes: made before
    the run (the client's CPU time goes to sending), and taken in turn. `count` of them are
    more than the prefix cache holds the queries of, and the engine's cache of texts seen
    twice (runtime.token_cache), so that a query or item never comes back cached. With a
    `tokenizer`, text: random tokens of its vocabulary, decoded, that encode as about as many
    tokens. With a `shelf` of N, a request's items are N's, drawn at random."""

    def __init__(self, vocab: int, seed: int, tokenizer: TextTokenizer | None = None,
                 count: int = 16384, shelf: int = 0):
        self.rng, self.tokenizer = np.random.default_rng(seed), tokenizer
        self.vocab = tokenizer.vocab_size - len(SPECIAL_TOKENS) if tokenizer else vocab
        self.labels = self.rng.integers(0, vocab, SHAPE["num_labels"]).tolist()
        n, k = SHAPE["num_items"], shelf or count * SHAPE["num_items"]
        if 0 < shelf < n:
            raise ValueError(f"a shelf of {shelf} items is less than a request's {n}")
        queries, items = (self._parts(count, SHAPE["query_tokens"]),
                          self._parts(k, SHAPE["item_tokens"]))
        picks = ([self.rng.choice(shelf, n, replace=False) for _ in range(count)] if shelf
                 else [range(j * n, (j + 1) * n) for j in range(count)])
        self._bodies = itertools.cycle([json.dumps(
            {"query": query, "items": [items[i] for i in pick], "label_token_ids": self.labels}
        ).encode() for query, pick in zip(queries, picks)])

    def _parts(self, count: int, tokens: int) -> list:
        ids = self.rng.integers(len(SPECIAL_TOKENS) if self.tokenizer else 0, self.vocab,
                                (count, tokens)).tolist()
        if not self.tokenizer:
            return ids
        # Random tokens decoded encode again as more tokens: keep the first `tokens` of those.
        texts = self.tokenizer.encode_pieces([self.tokenizer.decode(part) for part in ids])
        return [self.tokenizer.decode(part[:tokens]) for part in texts]

    def next(self) -> bytes:
        return next(self._bodies)


def text_tokenizer(model_path: str, text: bool) -> TextTokenizer | None:
    return TextTokenizer.from_file(os.path.join(model_path, "tokenizer.json")) if text else None


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process and the processes it started (an engine process
    a replica), all their threads (Linux /proc)."""
    stats = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue  # not a process, or gone
        stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, grown = set(), {pid}
    while grown != tree:
        tree = grown
        grown = tree | {p for p, (parent, _) in stats.items() if parent in tree}
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


async def counters(pool: ConnectionPool) -> dict:
    """The server's forward counters; None for those it does not report."""
    text = (await pool.request("GET", "/metrics")).body.decode()
    found = {key: re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
             for key, name in _COUNTERS.items()}
    return {key: float(m.group(1)) if m else None for key, m in found.items()}


async def closed_loop(pool: ConnectionPool, bodies: Bodies, clients: int, seconds: float):
    """(answer times, latencies, statuses) of `clients` clients for `seconds`."""
    done, latencies, statuses = [], [], []
    stop = time.perf_counter() + seconds

    async def client():
        while (sent := time.perf_counter()) < stop:
            answer = await pool.request("POST", "/v1/score", bodies.next())
            done.append(time.perf_counter())
            latencies.append(done[-1] - sent)
            statuses.append(answer.status)

    await asyncio.gather(*(client() for _ in range(clients)))
    return done, latencies, statuses


def _delta(after: dict, before: dict, key: str) -> float | None:
    return None if after[key] is None else after[key] - before[key]


async def level(url: str, pid: int, bodies: Bodies, clients: int, seconds: float,
                warmup: float, window: float, chips: ChipLog | None = None) -> dict:
    pool = ConnectionPool(url)
    await closed_loop(pool, bodies, clients, warmup)
    held = chips.read() if chips else None
    before, cpu_before, start = await counters(pool), cpu_seconds(pid), time.perf_counter()
    done, latencies, statuses = await closed_loop(pool, bodies, clients, seconds)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu_before
    if chips:
        held = chips.read() - held
    after = await counters(pool)
    pool.close()
    ok = [lat for lat, status in zip(latencies, statuses) if status == 200]
    n, forwards = len(ok), _delta(after, before, "forwards")
    in_flight, host = _delta(after, before, "in_flight_s"), _delta(after, before, "host_s")
    cached, tokenized = (_delta(after, before, key) for key in ("cached_texts",
                                                                 "tokenized_texts"))
    row = {"clients": clients, "requests": len(statuses), "errors": len(statuses) - n,
           "elapsed_s": elapsed, "items_per_s": n * SHAPE["num_items"] / elapsed,
           "req_per_s": n / elapsed, "forwards": forwards,
           "latency_ms": {"p50": float(np.percentile(ok, 50)) * 1e3 if ok else None,
                          "p99": float(np.percentile(ok, 99)) * 1e3 if ok else None},
           "server_cpu_ms_per_request": cpu / max(n, 1) * 1e3,
           "requests_per_forward": n / forwards if forwards else None,
           "forward_in_flight_share": in_flight / elapsed if in_flight is not None else None,
           "scheduler_cpu_ms_per_forward": host / forwards * 1e3 if host and forwards else None,
           "texts_cached_share": cached / (cached + tokenized) if cached or tokenized else None}
    if chips:
        row["chip_busy"] = (held[:, 0] / elapsed).tolist()
        row["chip_forwards"] = held[:, 1].tolist()
    if window > 0:
        times = np.asarray(done) - start
        edges = np.arange(0.0, seconds + window / 2, window)
        counts = np.histogram(times[(times >= 0) & (times < seconds)], edges)[0]
        row["items_per_s_by_window"] = (counts * SHAPE["num_items"] / window).tolist()
    return row


def request_path_us(model_path: str, text: bool, count: int = 400, seed: int = 0,
                    shelf: int = 0) -> dict:
    """The per-request path, in this process on this checkout's own functions: the HTTP head
    and body read, its JSON read and typed (server.json_codec.parse_score_body), checking,
    tokenizing and packing (Engine.prepare), and the answer encoded; microseconds per request
    by stage, the median of three passes, each over `count` requests of its own (the engine
    keeps the token ids of texts seen twice)."""
    engine = Engine.from_path(model_path, EngineConfig(warmup=False))
    bodies = Bodies(engine.cfg.vocab_size, seed, text_tokenizer(model_path, text), 3 * count,
                    shelf)
    raw = [b"POST /v1/score HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b)
           for b in (bodies.next() for _ in range(3 * count))]
    answer = {"scores": np.random.default_rng(seed).random(
        (SHAPE["num_items"], SHAPE["num_labels"])).tolist(), "model": "default",
        "object": "scoring", "usage": {"prompt_tokens": 300, "completion_tokens": 0,
                                       "total_tokens": 300}}

    async def read_all(data: list[bytes]) -> tuple[float, list]:
        start, out, deadlines = time.perf_counter(), [], ReadDeadlines(Limits().sweep_s)
        for one in data:
            reader = asyncio.StreamReader()
            reader.feed_data(one)
            reader.feed_eof()
            out.append(await read_request(reader, Limits(), deadlines))
        return (time.perf_counter() - start) / len(data) * 1e6, out

    def passes(stage, inputs) -> tuple[float, list]:
        times, outputs = [], []
        for part in (inputs[k::3] for k in range(3)):
            start = time.perf_counter()
            outputs += [stage(x) for x in part]
            times.append((time.perf_counter() - start) / len(part) * 1e6)
        return statistics.median(times), outputs

    try:
        runs = [asyncio.run(read_all(raw[k::3])) for k in range(3)]
        stages = {"http_read": statistics.median(t for t, _ in runs)}
        reqs = [req for _, part in runs for req in part]
        stages["parse"], typed = passes(lambda r: parse_score_body(r.body), reqs)
        stages["prepare"], _ = passes(engine.prepare, typed)
        stages["answer"], _ = passes(lambda _: encode_response(200, answer, True), typed)
    finally:
        engine.close()
    return {**stages, "total": sum(stages.values())}


def run(model_path: str, roots: list[str], concurrency: list[int], duration: float,
        warmup: float, text: bool, window: float = 0.0, server_args: str = "",
        seed: int = 0, chip: str = "", chips: int = 1, shelf: int = 0) -> dict:
    servers = {}
    with tempfile.TemporaryDirectory() as scratch:
        log = ChipLog(os.path.join(scratch, "chips"), chips, create=True) if chip else None
        module, args = (("profiling.simulated_server", f"{server_args} --chip_model {chip} "
                         f"--chip_log {scratch}/chips --dp-size {chips}") if chip
                        else ("server", server_args))
        for root in roots:
            with running_server(model_path, args, cwd=root, module=module) as served:
                bodies = Bodies(asyncio.run(server_vocab(served.url)), seed,
                                text_tokenizer(model_path, text), shelf=shelf)
                rows = [asyncio.run(level(served.url, served.pid, bodies, c, duration, warmup,
                                          window, log)) for c in concurrency]
                servers[root] = {"devices": served.devices, "levels": rows}
    return {"shape": {**SHAPE, "text": text, "distinct_queries": True, "shelf": shelf},
            "chip": {"model": chip, "chips": chips} if chip else None,
            "request_path_us": request_path_us(model_path, text, seed=seed, shelf=shelf),
            "model_path": model_path, "server_args": server_args, "duration_s": duration,
            "warmup_s": warmup, "cpu": platform.processor() or platform.machine(),
            "threads": os.cpu_count(), "timing": "client wall clock; server CPU from /proc",
            "servers": servers}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv) -> None:
    del argv
    with tempfile.TemporaryDirectory() as scratch:
        model = FLAGS.model_path or tiny_checkpoint(os.path.join(scratch, "tiny"),
                                                    FLAGS.embedded_tokenizer)
        result = run(model, FLAGS.server_roots, [int(c) for c in FLAGS.concurrency],
                     FLAGS.duration, FLAGS.warmup, FLAGS.text, FLAGS.window, FLAGS.server_args,
                     FLAGS.seed, FLAGS.chip, FLAGS.chips, FLAGS.shelf)
    print("per-request path, this checkout, us:", ", ".join(
        f"{k} {v:.0f}" for k, v in result["request_path_us"].items()))
    print("root | clients | items/s | req/s | p50 ms | p99 ms | server CPU ms/req | "
          "req/forward | in flight | scheduler CPU ms/forward | texts cached | chips busy")
    for root, server in result["servers"].items():
        for r in server["levels"]:
            print(f"{root} | {r['clients']} | {r['items_per_s']:.0f} | {r['req_per_s']:.0f} | "
                  f"{_fmt(r['latency_ms']['p50'], '.1f')} | {_fmt(r['latency_ms']['p99'], '.1f')}"
                  f" | {r['server_cpu_ms_per_request']:.2f} | "
                  f"{_fmt(r['requests_per_forward'], '.1f')} | "
                  f"{_fmt(r['forward_in_flight_share'], '.0%')} | "
                  f"{_fmt(r['scheduler_cpu_ms_per_forward'], '.2f')} | "
                  f"{_fmt(r['texts_cached_share'], '.0%')} | "
                  + (" ".join(f"{b:.0%}" for b in r["chip_busy"]) if "chip_busy" in r
                     else "-"))
            if "items_per_s_by_window" in r:
                print("  items/s by window:", " ".join(f"{x:.0f}"
                                                      for x in r["items_per_s_by_window"]))
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
