"""The serving runtime: prefix reuse, batching across requests, eviction, zero recompiles."""
import re

import jax
import numpy as np
import pytest
from jax import monitoring

from model.loader import load_config
from runtime.engine import Engine
from runtime.forward_programs import CACHE_HIT_EVENT, server_programs
from runtime.request import parse_score_request
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.tiny_models import VOCAB, small_config


def make(model_dirs, family="qwen3", **overrides) -> Engine:
    return Engine.from_path(model_dirs[family], small_config(**overrides))


@pytest.fixture
def new_engine(model_dirs):
    """Engines made by a test, closed after it whether it passes or fails."""
    made = []

    def new(family="qwen3", **overrides) -> Engine:
        made.append(make(model_dirs, family, **overrides))
        return made[-1]
    yield new
    for engine in made:
        engine.close()


@pytest.fixture(scope="module")
def uncached(model_dirs):
    engines = {f: make(model_dirs, f, prefix_cache=False) for f in ("qwen3", "llama", "qwen3_cls")}
    yield engines
    for engine in engines.values():
        engine.close()


def random_request(rng, query=None, vocab=VOCAB):
    if query is None:
        query = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
    items = [rng.integers(0, vocab, int(n)).tolist()
             for n in rng.integers(0, 10, int(rng.integers(1, 12)))]
    return parse_score_request(dict(
        query=query, items=items, label_token_ids=rng.integers(0, vocab, 3).tolist(),
        apply_softmax=bool(rng.integers(2)), item_first=bool(rng.random() < 0.25)))


@pytest.mark.parametrize("query_len", [7, 8, 16, 23, 40])  # page size 8: aligned or not
def test_prefix_hit_scores_equal_a_miss(engines, uncached, query_len):
    rng = np.random.default_rng(query_len)
    query = rng.integers(0, VOCAB, query_len).tolist()
    engine, before = engines["qwen3"], engines["qwen3"].scheduler.stats.cached_tokens
    for items in ([[1, 2], [3]], [[], [4, 5, 6]], [[7]], []):  # an empty item scores query's end
        req = parse_score_request(dict(query=query, items=items, label_token_ids=[5, 9]))
        assert_scores_close(engine.score_request(req).scores,
                            uncached["qwen3"].score_request(req).scores)
    hit = engine.scheduler.stats.cached_tokens - before
    # full query pages; with an empty item, only those before the query's last token
    assert hit == (query_len - 1) // 8 * 8 + query_len // 8 * 8


def test_concurrent_requests_equal_one_at_a_time(engines, uncached):
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 30).tolist()
    reqs = [random_request(rng, shared if k % 2 else None) for k in range(32)]
    engine = engines["qwen3"]
    forwards = engine.scheduler.stats.forwards
    futures = [engine.submit(r) for r in reqs]
    for req, future in zip(reqs, futures):
        assert_scores_close(future.result(120).scores, uncached["qwen3"].score_request(req).scores)
    assert engine.scheduler.stats.forwards - forwards < 32 / 2  # requests did share forwards
    assert_no_leaked_pages(engine)


@pytest.mark.parametrize("family", ["llama", "qwen3_cls"])
def test_text_and_classifier_requests_batch_together(engines, uncached, family):
    reqs = [parse_score_request(dict(query=f"query {k}", items=["yes", "", "no way"] * (k + 1),
                                     label_token_ids=[3, 4], item_first=k == 2))
            for k in range(6)]
    futures = [engines[family].submit(r) for r in reqs]
    rtol = 1e-5 if family == "qwen3_cls" else 0.0  # raw logits: float32 rounds by magnitude
    for req, future in zip(reqs, futures):
        want = uncached[family].score_request(req).scores
        assert_scores_close(future.result(60).scores, want, rtol=rtol)


def test_chunks_of_a_big_request_share_its_cached_query(new_engine, uncached):
    engine = new_engine(max_prefill_tokens=64, max_seqs=4, max_rows=16)
    rng = np.random.default_rng(5)
    req = parse_score_request(dict(query=rng.integers(0, VOCAB, 33).tolist(),
                                   items=[rng.integers(0, VOCAB, 5).tolist() for _ in range(20)],
                                   label_token_ids=[1, 2]))
    want = uncached["qwen3"].score_request(req).scores
    assert_scores_close(engine.score_request(req).scores, want)
    stats = engine.scheduler.stats
    assert stats.forwards >= 3 and stats.cached_tokens >= 32 * (stats.forwards - 1)
    assert_no_leaked_pages(engine)


def test_stats_count_the_bucket_tokens_each_forward_pads_to(uncached):
    engine = uncached["llama"]
    stats = engine.scheduler.stats
    computed, padded = stats.computed_tokens, stats.padded_tokens
    for query_len in (29, 30):  # 32 tokens fill the bucket of 32; 33 take the bucket of 48
        engine.score(query=list(range(1, query_len + 1)), items=[[1, 2], [3]],
                     label_token_ids=[1])
    assert stats.computed_tokens - computed == 32 + 33
    assert stats.padded_tokens - padded == 32 + 48


def test_eviction_under_a_pool_too_small_for_all_prefixes(new_engine, uncached):
    cfg = small_config(max_prefill_tokens=64, max_seqs=2, max_rows=16)
    engine = new_engine(**vars(cfg) | dict(kv_cache_tokens=cfg.min_kv_tokens))
    pages = engine.scheduler.pool.num_pages
    rng = np.random.default_rng(11)
    queries = [rng.integers(0, VOCAB, 40).tolist() for _ in range(8)]  # 5 cacheable pages each
    for rounds in range(2):
        for query in queries:
            req = parse_score_request(dict(query=query, items=[[1], [2, 3]], label_token_ids=[4]))
            want = uncached["qwen3"].score_request(req).scores
            for repeat in range(2):  # a miss (evicted since the last round), then a hit
                assert_scores_close(engine.score_request(req).scores, want)
                engine.scheduler.check_pages()
    assert 2 * 5 == pages  # one query's 5 pages, plus one batch in flight
    assert engine.scheduler.stats.cached_tokens == 2 * 8 * 40
    assert_no_leaked_pages(engine)


def test_warm_up_compiles_every_bucket_and_a_varied_stream_compiles_nothing(new_engine):
    engine = new_engine("llama", max_prefill_tokens=256, max_rows=128, warmup=True)
    compiled = engine.runner.compile_count
    assert compiled == len(engine.runner.buckets.token_sizes())
    compiles = []  # by XLA, or read from the suite's compilation cache (tests/conftest.py)
    listener = lambda event, duration, **kw: (  # noqa: E731
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    hits = lambda event, **kw: (  # noqa: E731
        compiles.append(event) if event == CACHE_HIT_EVENT else None)
    monitoring.register_event_duration_secs_listener(listener)
    monitoring.register_event_listener(hits)
    try:
        rng = np.random.default_rng(0)
        for k in range(40):
            n_items, n_labels = int(rng.integers(1, 129)), int(rng.integers(1, 65))
            long_query = k % 4 == 0
            query_len = int(rng.integers(60, 120)) if long_query else int(rng.integers(1, 8))
            item_len = 0 if n_items > 64 else int(rng.integers(0, 3))
            if k % 2:
                body = dict(query=" ".join(["word"] * query_len),
                            items=["x" * item_len] * n_items)
            else:
                body = dict(query=rng.integers(0, VOCAB, query_len).tolist(),
                            items=[rng.integers(0, VOCAB, item_len).tolist()] * n_items)
            body.update(label_token_ids=rng.integers(0, VOCAB, n_labels).tolist(),
                        apply_softmax=bool(k % 3), item_first=k % 7 == 0 and n_items < 8)
            result = engine.score_request(parse_score_request(body))
            assert np.array(result.scores).shape == (n_items, n_labels)
    finally:
        monitoring.unregister_event_duration_listener(listener)
        monitoring.unregister_event_listener(hits)
    assert engine.runner.compile_count == compiled
    assert compiles == []


def test_a_request_is_answered_after_its_pages_are_free(new_engine):
    """A client that has its answer finds the pass's pages back in the pool."""
    engine = new_engine("llama", prefix_cache=False)
    free_when_answered = []
    future = engine.submit(parse_score_request(
        {"query": [3, 4, 5] * 9, "items": [[6], [7, 8]], "label_token_ids": [1, 2]}))
    future.add_done_callback(lambda f: free_when_answered.append(engine.scheduler.pool.free_count))
    future.result(60)
    assert free_when_answered == [engine.scheduler.pool.num_pages]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_forwards_ask_every_dot_for_float32_arithmetic(model_dirs, dtype):
    """At the default precision a GPU rounds float32 operands to TF32 and a TPU to bfloat16
    (CPU ignores the request, so this reads the program): every dot of a float32 forward asks
    for HIGHEST, and a bfloat16 forward's ask for nothing."""
    programs = server_programs(small_config(dtype=dtype), load_config(model_dirs["qwen3"]),
                               jax.devices()[:1], num_pages=64)
    text = programs.lower(programs.buckets.all_shapes()[0]).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert len(dots) >= 7, dots  # q, k, v, out, gate, up, down at least
    assert [("HIGHEST" in dot) for dot in dots] == [dtype == "float32"] * len(dots)
