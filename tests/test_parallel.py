"""Tensor and data parallelism on eight CPU devices (see conftest): the scores of one device."""
import concurrent.futures
import dataclasses
import subprocess
import sys
import types

import numpy as np
import pytest

from model.loader import load_model
from model.sharding import shard_plan
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.router import Router
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.server_harness import call, metric, serving
from tests.tiny_models import FAMILIES, KV_HEADS, VOCAB, small_config, write_checkpoint

LABELS = [5, 100, 250, VOCAB - 1]  # across the vocabulary shards


def requests(family: str, seed: int, n: int = 3) -> list[dict]:
    """A text request and `n` small token ones (the last items first): a forward or two of
    16 tokens each, so that an engine compiles few programs."""
    rng, labels = np.random.default_rng(seed), None if family == "qwen3_cls" else LABELS
    out = [dict(query="Tokyo is a city", items=[" in Japan", " in France"],
                label_token_ids=labels, apply_softmax=True)]
    for k in range(n):
        items = [rng.integers(0, VOCAB, int(m)).tolist() for m in rng.integers(0, 4, 3)]
        out.append(dict(query=rng.integers(0, VOCAB, int(rng.integers(1, 7))).tolist(),
                        items=items, label_token_ids=labels, apply_softmax=bool(k % 2),
                        item_first=k == n - 1))
    return out


def scores(engine: Engine, reqs: list[dict]) -> list:
    return [engine.score(**r).scores for r in reqs]


def assert_same_scores(got: list, want: list, family: str) -> None:
    for g, w in zip(got, want, strict=True):
        assert_scores_close(g, w, atol=1e-5, rtol=1e-6 if family == "qwen3_cls" else 0.0)


@pytest.fixture
def make(model_dirs):
    made = []

    def make_engine(family="qwen3", model_dir=None, **overrides) -> Engine:
        made.append(Engine.from_path(model_dir or model_dirs[family], small_config(**overrides)))
        return made[-1]

    yield make_engine
    for engine in made:
        engine.close()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_scores_equal_one_device(engines, make, family, tp):
    reqs = requests(family, seed=tp)
    engine = make(family, tp_size=tp)
    got = scores(engine, reqs)
    assert_same_scores(got, scores(engines[family], reqs), family)
    kv_heads = engine.runner.cache.k.addressable_shards[0].data.shape[1]
    assert kv_heads == max(1, KV_HEADS // tp)  # each device holds its own KV heads only
    wq = engine.runner.params["layer_matrices"][0]["wq"]  # on CPU: one array per layer, [out, in]
    assert wq.addressable_shards[0].data.shape[0] == wq.shape[0] // tp
    assert len(engine.runner.devices) == tp
    assert_no_leaked_pages(engine)


def test_vocabulary_that_does_not_split_stays_whole(make, tmp_path):
    model_dir = write_checkpoint(str(tmp_path / "odd"), "llama", seed=7, vocab=VOCAB + 1)
    one, two = make(model_dir=model_dir), make(model_dir=model_dir, tp_size=2)
    assert not two.runner.shards.vocab_parallel and two.runner.shards.tp == 2
    reqs = requests("llama", seed=1)
    assert_same_scores(scores(two, reqs), scores(one, reqs), "llama")


def test_pallas_kernels_in_shard_map_run_in_the_tpu_interpreter(engines, make):
    engine = make("qwen2", tp_size=2, kernel_backend="interpret")
    req = dict(query=[3, 1, 4, 1, 5, 9, 2, 6, 5], items=[[3, 5], [8, 9, 7, 9]],
               label_token_ids=LABELS)  # logsumexp: the streamed kernel per vocabulary shard
    assert_same_scores([engine.score(**req).scores], [engines["qwen2"].score(**req).scores],
                       "qwen2")


@pytest.mark.parametrize("tp, dp, devices", [(3, 1, "num_heads=4"), (1, 9, "needs 9 devices")])
def test_impossible_layouts_are_refused(model_dirs, tp, dp, devices):
    with pytest.raises(ValueError, match=devices):
        Engine.from_path(model_dirs["qwen3"], small_config(tp_size=tp, dp_size=dp))
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(tp_size=0)


def test_kv_heads_and_tp_must_divide_one_another(model_dirs):
    cfg, _, _ = load_model(model_dirs["qwen3"])
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        shard_plan(dataclasses.replace(cfg, num_heads=6), 3)


def test_data_parallel_serves_concurrent_requests_with_the_same_scores(engines, make):
    engine = make("qwen3", dp_size=2)
    reqs = requests("qwen3", seed=5, n=7)
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        got = list(pool.map(lambda r: engine.score(**r).scores, reqs))
    assert_same_scores(got, scores(engines["qwen3"], reqs), "qwen3")
    assert all(s.stats.forwards > 0 for s in engine.schedulers)  # both replicas worked
    first, second = (set(s.runner.devices) for s in engine.schedulers)
    assert not first & second
    assert_no_leaked_pages(engine)


def test_tp_and_dp_together_through_the_server(engines, make):
    engine = make("llama", tp_size=2, dp_size=2)
    reqs = requests("llama", seed=11, n=5)
    with serving(engine) as port, concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        answers = list(pool.map(lambda r: call(port, "POST", "/v1/score", r), reqs))
        assert metric(port, "jax_score_replicas") == "2"
        info = call(port, "GET", "/get_model_info")[1]
    assert [a[0] for a in answers] == [200] * len(reqs)
    assert_same_scores([a[1]["scores"] for a in answers], scores(engines["llama"], reqs), "llama")
    assert (info["tp_size"], info["dp_size"]) == (2, 2)


def test_prefix_affine_routing_hits_the_cache(make):
    engine = make("qwen3", dp_size=2)
    rng = np.random.default_rng(3)
    query = rng.integers(0, VOCAB, 40).tolist()  # five pages of 8 tokens
    for k in range(3):
        engine.score(query, [[k, 7], [9]], label_token_ids=LABELS)
        for _ in range(2):  # new queries between repeats: taking turns alone would alternate
            engine.score(rng.integers(0, VOCAB, 40).tolist(), [[1, 2]], label_token_ids=LABELS)
    assert engine.router.affine_routes == 2
    assert sum(s.stats.cached_tokens for s in engine.schedulers) == 2 * 40
    assert_no_leaked_pages(engine)


def fake_schedulers(*loads):
    return [types.SimpleNamespace(load=n) for n in loads]


def test_router_prefers_the_query_home_until_it_is_overloaded():
    schedulers = fake_schedulers(0, 0)
    router = Router(schedulers, slack_tokens=100)
    home = router.pick(b"q")
    schedulers[home].load = 100  # within the slack: stays
    assert router.pick(b"q") == home
    schedulers[home].load = 101  # beyond: moves, and the query's home moves with it
    moved = router.pick(b"q")
    assert moved != home and router.pick(b"q") == moved
    assert router.affine_routes == 2


def test_router_spreads_new_work_to_the_least_loaded():
    schedulers = fake_schedulers(50, 10, 30)
    router = Router(schedulers, slack_tokens=0, capacity=2)
    assert router.pick(None) == 1 and router.pick(b"a") == 1
    assert {router.pick(None) for _ in range(4)} == {1}
    schedulers[1].load = 50
    assert router.pick(b"b") == 2
    router.pick(b"c")  # capacity 2: the oldest home is forgotten
    schedulers[2].load = 0
    assert router.pick(b"a") == 2 and router.affine_routes == 0


def test_cli_refuses_a_layout_the_model_cannot_take(model_dirs):
    proc = subprocess.run([sys.executable, "-m", "server", "--model-path", model_dirs["qwen3"],
                           "--port", "0", "--tp-size", "3", "--skip-warmup"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--tp-size 3 does not divide num_heads=4" in proc.stderr
