"""Data parallel replicas in engine processes of their own (runtime.replica_process), on CPU:
the same scores as one process, bit for bit; the router, the server's routes and metrics over
them; a replica that cannot start, and one killed under load."""
import concurrent.futures
import os
import signal
import time

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.errors import ScoreError
from runtime.replica_process import _ENCODE, _TO_FRONT, Submit, WireUnit, _RemoteJob, _Results
from runtime.request import parse_score_request
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.server_harness import call, metric, serving
from tests.test_parallel import LABELS, requests, scores
from tests.tiny_models import VOCAB, small_config


def processes_config(**overrides):
    return small_config(dp_size=2, replica_processes=True, **overrides)


@pytest.fixture(scope="module")
def engine(model_dirs):
    engine = Engine.from_path(model_dirs["qwen3"], processes_config())
    yield engine
    engine.close()


class _SentMessages(list):
    def send(self, front: str, message) -> None:
        self.append((front, _TO_FRONT.decode(_ENCODE.encode(message))))


def test_a_forwards_results_go_as_one_message_a_front_end():
    """An engine process holds its units' results until the scheduler says the forward is
    answered, then sends one message to each front end with the results of its jobs."""
    sent = _SentMessages()
    results = _Results(sent)
    unit = WireUnit(b"", b"", b"", 0, 0, 0, 0, 1)
    jobs = [_RemoteJob(Submit(front, job, [7, 8], "logits", [unit, unit]), results, sent,
                       lambda job: None) for front, job in (("a", 0), ("b", 1), ("a", 2))]
    for k, job in enumerate(jobs):
        job.unit_done(range(0, 1), np.full((1, 2), k), 10)
    jobs[0].unit_done(range(1, 2), np.full((1, 2), 3), 10)
    assert sent == []
    results.send()
    assert [(front, [(d.job, d.start, np.frombuffer(d.scores).tolist()) for d in m.done])
            for front, m in sent] == [("a", [(0, 0, [0, 0]), (2, 0, [2, 2]), (0, 1, [3, 3])]),
                                      ("b", [(1, 0, [1, 1])])]
    results.send()
    assert len(sent) == 2  # nothing held: nothing sent


def test_scores_equal_one_process_bit_for_bit(engines, engine):
    reqs = requests("qwen3", seed=21, n=6)  # distinct queries: no forward reads a cached one
    engines["qwen3"].flush_prefix_cache()  # nor one cached by earlier tests
    assert scores(engine, reqs) == scores(engines["qwen3"], reqs)
    assert [p.process.is_alive() for p in engine.schedulers] == [True, True]
    assert engine.describe().count("in processes of their own") == 1


def test_concurrent_requests_spread_over_both_replicas(engines, engine):
    before = [s.forwards for s in engine.statuses()]
    reqs = requests("qwen3", seed=22, n=15)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: engine.score(**r).scores, reqs))
    for g, w in zip(got, scores(engines["qwen3"], reqs), strict=True):
        assert_scores_close(g, w)
    assert all(s.forwards > b for s, b in zip(engine.statuses(), before))
    assert [p.load for p in engine.schedulers] == [0, 0]  # every unit answered
    assert_no_leaked_pages(engine)


def test_a_repeated_query_goes_back_to_its_replica(engine):
    rng = np.random.default_rng(3)
    query = rng.integers(0, VOCAB, 40).tolist()  # five pages of 8 tokens
    cached, routes = sum(s.cached_tokens for s in engine.statuses()), engine.router.affine_routes
    for k in range(3):
        engine.score(query, [[k, 7], [9]], label_token_ids=LABELS)
        engine.score(rng.integers(0, VOCAB, 40).tolist(), [[1, 2]], label_token_ids=LABELS)
    assert engine.router.affine_routes - routes == 2
    assert sum(s.cached_tokens for s in engine.statuses()) - cached == 2 * 40


def test_the_server_over_replica_processes(engines, engine):
    reqs = requests("qwen3", seed=23, n=3)[1:]  # the text one's query is cached by now
    with serving(engine) as port:
        answers = [call(port, "POST", "/v1/score", r) for r in reqs]
        assert metric(port, "jax_score_replicas") == "2"
        assert int(float(metric(port, "jax_score_forwards_total"))) >= len(reqs)
        info = call(port, "GET", "/get_model_info")[1]
    assert [a[0] for a in answers] == [200] * len(reqs)
    assert [a[1]["scores"] for a in answers] == scores(engines["qwen3"], reqs)
    assert (info["dp_size"], info["kernel_backend"], info["dtype"]) == (2, "xla", "float32")


def test_a_replica_that_cannot_start_stops_them_all(model_dirs):
    before = _children()
    with pytest.raises(ValueError, match="num_heads=4"):
        Engine.from_path(model_dirs["qwen3"], processes_config(tp_size=3))
    assert _children() <= before


def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(model_dirs):
    engine = Engine.from_path(model_dirs["qwen3"], processes_config())
    try:
        rng = np.random.default_rng(5)
        reqs = [dict(query=rng.integers(0, VOCAB, 60).tolist(),
                     items=[rng.integers(0, VOCAB, 20).tolist() for _ in range(6)],
                     label_token_ids=LABELS) for _ in range(24)]
        futures = [engine.submit(parse_score_request(r, True)) for r in reqs]
        settled = {}
        for f in futures:
            f.add_done_callback(lambda f: settled.setdefault(id(f), time.monotonic()))
        victim = engine.schedulers[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        outcomes = []
        for f in futures:
            try:
                outcomes.append(len(f.result(timeout=60).scores))
            except ScoreError as e:
                outcomes.append(e.status)
                assert settled[id(f)] - killed < 1.0  # its requests fail at once
        assert set(outcomes) <= {6, 503} and 503 in outcomes
        for k in range(4):  # new requests go to the replica left (or the one back)
            assert len(engine.score(**reqs[k]).scores) == 6
        assert len(engine.statuses()) == 2  # a dead one's last
        assert engine.schedulers[1].load == 0
    finally:
        engine.close()


def _children() -> set[int]:
    mine = str(os.getpid())
    out = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == mine and fields[0] != "Z" and b"resource_tracker" not in open(
                f"/proc/{entry}/cmdline", "rb").read():
            out.add(int(entry))
    return out


def test_a_killed_engine_process_comes_back_and_health_says_so_meanwhile(model_dirs):
    engine = Engine.from_path(model_dirs["qwen3"], processes_config())
    try:
        with serving(engine) as port:
            assert call(port, "GET", "/health")[0] == 200
            victim = engine.schedulers[1]
            first = victim.process.pid
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while victim.alive and time.monotonic() < deadline:
                time.sleep(0.02)
            status, body, _ = call(port, "GET", "/health")
            assert status == 503 and "replica 1: its engine process" in body["message"]
            deadline = time.monotonic() + 120
            while not victim.alive and time.monotonic() < deadline:
                time.sleep(0.1)
            assert victim.alive and victim.process.pid != first
            assert call(port, "GET", "/health")[0] == 200
            reqs = requests("qwen3", seed=24, n=6)
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda r: call(port, "POST", "/v1/score", r), reqs))
            assert [a[0] for a in answers] == [200] * len(reqs)
        assert all(s.forwards > 0 for s in engine.statuses())  # the new process served too
    finally:
        engine.close()
