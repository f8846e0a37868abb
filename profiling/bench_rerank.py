"""Reranking on a running server's /v1/rerank: documents per second by documents per request,
for a new query each request (only the template's text before the query is in the prefix
cache) and for the same query again (the whole shared prompt is).

python -m profiling.bench_rerank --url http://127.0.0.1:30000 [--documents 10,50,200]
    [--doc-words 75] [--repeats 3] [--seed 0] [--out bench_rerank.json]

Documents are `doc_words` words drawn from a fixed list (about 100 tokens for SmolLM2's
tokenizer); each request is sent alone, one after another. Timing: wall clock on the client,
median of `repeats` requests per cell.
"""
import asyncio
import statistics
import time

import numpy as np
from absl import app, flags

from profiling.score_client import ConnectionPool
from profiling.timing import write_json
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS
WORDS = ("the of and to in is was for on that with as by at from his her an which were are "
         "this be has had not but they their one all two new more first after who its been "
         "also time year city river music world school water history system market energy "
         "court season church island species album film party design family science "
         "language village station company museum garden forest mountain engine bridge "
         "country theory protein network battle novel festival harbour temple").split()


def text(words: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, words)).capitalize() + "."


async def timed(pool: ConnectionPool, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    answer = await pool.post_json("/v1/rerank", body)
    return time.perf_counter() - start, answer


async def cell(pool: ConnectionPool, documents: int, doc_words: int, repeats: int,
               cached: bool, rng: np.random.Generator) -> dict:
    """`repeats` requests of `documents` documents; cached: every query the same, the first
    request (which fills the cache) not counted."""
    query = text(12, rng)
    if cached:
        await timed(pool, {"query": query, "documents": [text(doc_words, rng)]})
    seconds, tokens = [], []
    for _ in range(repeats):
        body = {"query": query if cached else text(12, rng), "return_documents": False,
                "documents": [text(doc_words, rng) for _ in range(documents)]}
        s, answer = await timed(pool, body)
        assert len(answer["results"]) == documents, answer
        seconds.append(s)
        tokens.append(answer["usage"]["prompt_tokens"])
    latency = statistics.median(seconds)
    return {"documents": documents, "query_cached": cached, "latency_s": latency,
            "documents_per_s": documents / latency,
            "prompt_tokens_per_document": statistics.median(tokens) / documents}


async def bench(url: str, counts: list[int], doc_words: int, repeats: int, seed: int) -> dict:
    rng, pool = np.random.default_rng(seed), ConnectionPool(url)
    try:
        info = await pool.get_json("/get_model_info")
        rows = [await cell(pool, n, doc_words, repeats, cached, rng)
                for n in counts for cached in (False, True)]
    finally:
        pool.close()
    return {"url": url, "model": info["model_path"], "dtype": info["dtype"],
            "doc_words": doc_words, "repeats": repeats, "rows": rows}


def main(argv) -> None:
    del argv
    result = asyncio.run(bench(FLAGS.url, [int(n) for n in FLAGS.documents], FLAGS.doc_words,
                               FLAGS.repeats, FLAGS.seed))
    print(f"{result['model']} ({result['dtype']}), documents of {FLAGS.doc_words} words")
    for r in result["rows"]:
        query = "the same query" if r["query_cached"] else "a new query   "
        print(f"{r['documents']:4d} documents, {query}: {r['documents_per_s']:7.1f} "
              f"documents/s, {r['latency_s'] * 1e3:8.0f} ms, "
              f"{r['prompt_tokens_per_document']:.0f} prompt tokens per document")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    flags.DEFINE_string("url", "http://127.0.0.1:30000", "the server")
    flags.DEFINE_list("documents", ["10", "50", "200"], "documents per request")
    flags.DEFINE_integer("doc_words", 75, "words per document")
    flags.DEFINE_integer("repeats", 3, "timed requests per cell")
    flags.DEFINE_integer("seed", 0, "seed of the texts")
    flags.DEFINE_string("out", None, "write the results as JSON here")
    app.run(main, flags_parser=parse_flags)
