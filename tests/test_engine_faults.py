"""A failed forward fails only its own batch; cancelled requests leave; no page ever leaks."""
import concurrent.futures

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.errors import ScoreError
from runtime.request import parse_score_request
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.gated_runner import GatedRunner
from tests.tiny_models import VOCAB, small_config


@pytest.fixture
def engine(model_dirs) -> Engine:
    engine = Engine.from_path(model_dirs["qwen3"], small_config(max_prefill_tokens=64, max_seqs=4,
                                                                max_rows=16))
    yield engine
    engine.close()


def request(query, items, labels=(1, 2), **kw):
    return parse_score_request(dict(query=query, items=items, label_token_ids=list(labels), **kw))


def test_failure_after_cache_donation_does_not_break_later_requests(engine, monkeypatch):
    want = engine.score("a query", ["x", "yz"], [1, 2]).scores

    def failing_program(params, cache, batch):
        cache.k.delete()  # what a device fault after donation leaves behind
        cache.v.delete()
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine.runner.programs, "get", lambda *a: failing_program)
    with pytest.raises(ScoreError, match="device fault") as err:
        engine.score("a query", ["x", "yz"], [1, 2])
    assert err.value.status == 500
    assert_no_leaked_pages(engine)
    monkeypatch.undo()
    assert engine.score("a query", ["x", "yz"], [1, 2]).scores == want


def test_a_failed_batch_fails_only_its_requests(engine, monkeypatch):
    gate = GatedRunner(engine.runner, monkeypatch, fail=lambda call: call == 1)
    first = engine.submit(request("first", ["a"]))
    assert gate.entered.wait(60)  # the first forward holds; the next two queue together
    doomed = [engine.submit(request(q, ["b", "c"])) for q in ("second", "third")]
    gate.release.set()
    assert len(first.result(60).scores) == 1
    for future in doomed:
        with pytest.raises(ScoreError, match="injected fault in forward 1"):
            future.result(60)
    assert gate.rows == [1, 4]
    assert len(engine.score("after", ["d"], [1, 2]).scores) == 1
    assert_no_leaked_pages(engine)


def test_cancelled_requests_leave_the_queue_and_free_their_pages(engine, monkeypatch):
    gate = GatedRunner(engine.runner, monkeypatch)
    running = engine.submit(request("running", ["a", "b"]))
    assert gate.entered.wait(60)
    queued = engine.submit(request("queued", ["c"] * 3))
    assert queued.cancel() and running.cancel()  # cancelled while queued, and mid-forward
    kept = engine.submit(request("kept", ["d"]))
    gate.release.set()
    assert len(kept.result(60).scores) == 1
    assert gate.rows == [2, 1]  # the cancelled request's rows were never computed
    assert_no_leaked_pages(engine)


def test_pages_balance_after_random_faults_and_cancellations(engine, monkeypatch):
    rng = np.random.default_rng(7)
    faults = rng.random(200) < 0.3
    gate = GatedRunner(engine.runner, monkeypatch, fail=lambda call: faults[call])
    gate.release.set()
    reqs = [request(rng.integers(0, VOCAB, int(rng.integers(1, 40))).tolist(),
                    [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(0, 9, 1 + k % 6)],
                    item_first=bool(k % 3 == 0), apply_softmax=bool(k % 2))
            for k in range(24)]
    futures = [engine.submit(r) for r in reqs]
    for k, future in enumerate(futures):
        if k % 5 == 0:
            future.cancel()
    outcomes, done = {"ok": 0, "failed": 0, "cancelled": 0}, []
    for req, future in zip(reqs, futures):
        try:
            done.append((req, future.result(120).scores))
        except concurrent.futures.CancelledError:
            outcomes["cancelled"] += 1
        except ScoreError as e:
            assert e.status == 500 and "injected fault" in e.message
            outcomes["failed"] += 1
    outcomes["ok"] = len(done)
    assert min(outcomes.values()) > 0, outcomes
    assert_no_leaked_pages(engine)
    gate.fail = lambda call: False
    for req, got in done:
        assert_scores_close(got, engine.score_request(req).scores)


@pytest.mark.parametrize("policy, order, rows", [
    ("fcfs", ["blocker", "big"] + ["small"] * 6, [1, 3]),  # nothing jumps ahead of the big one
    ("fair", ["blocker"] + ["small"] * 6 + ["big"], [1, 3, 4, 5])])  # its turn comes back
def test_a_big_request_is_never_starved(model_dirs, monkeypatch, policy, order, rows):
    engine = Engine.from_path(model_dirs["qwen3"], small_config(
        max_prefill_tokens=64, max_seqs=4, max_rows=16, schedule_policy=policy))
    try:
        assert_big_request_finishes(engine, monkeypatch, order, rows)
    finally:
        engine.close()


def assert_big_request_finishes(engine, monkeypatch, order, rows):
    gate = GatedRunner(engine.runner, monkeypatch)
    finished = []
    blocker = engine.submit(request("blocker", ["a"]))
    assert gate.entered.wait(60)
    big = engine.submit(request([7] * 30, [[8] * 10] * 6))  # two chunks: 64-token budget
    small = [engine.submit(request([9], [[k]])) for k in range(6)]  # each fits anywhere
    for name, future in [("blocker", blocker), ("big", big)] + [("small", f) for f in small]:
        future.add_done_callback(lambda f, name=name: finished.append(name))
    gate.release.set()
    for future in [blocker, big, *small]:
        future.result(60)
    assert finished == order
    assert gate.rows[:len(rows)] == rows
