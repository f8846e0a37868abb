"""The pipelined scheduler: the host prepares forward N+1 while forward N runs, and nothing it
answers differs from running them one after another. Orders are asserted, never timed."""
import collections
import concurrent.futures
import threading

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.errors import ScoreError
from runtime.job import Job
from runtime.request import parse_score_request
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.gated_runner import GatedRunner
from tests.tiny_models import small_config

QUERY = list(range(3, 23))  # 20 tokens: two full pages of 8 for the prefix cache
FIRST = parse_score_request(dict(query=QUERY, items=[[30, 31], [32]], label_token_ids=[1, 2]))
SECOND = parse_score_request(dict(query=QUERY, items=[[40], [41, 42, 43], [44]],
                                  label_token_ids=[5, 6, 7]))
PIPELINED = ["dispatch 0", "dispatch 1", "collect 0", "collect 1"]
SERIAL = ["dispatch 0", "collect 0", "dispatch 1", "collect 1"]


def engine_of_depth(model_dirs, depth: int) -> Engine:
    return Engine.from_path(model_dirs["qwen3"], small_config(
        max_prefill_tokens=64, max_seqs=4, max_rows=16, pipeline_depth=depth))


def second_behind_first(engine: Engine, gate: GatedRunner):
    """FIRST's forward formed and held at its dispatch, SECOND submitted behind it: with room
    in the pipeline, SECOND's forward is formed while FIRST's runs."""
    first = engine.submit(FIRST)
    assert gate.entered.wait(60)
    second = engine.submit(SECOND)
    gate.release.set()
    return first, second


@pytest.fixture
def answered_units(monkeypatch):
    """(job, items) of every unit answered, in order."""
    calls = []
    real = Job.unit_done

    def record(job, items, *args):
        calls.append((id(job), tuple(items)))
        return real(job, items, *args)
    monkeypatch.setattr(Job, "unit_done", record)
    return calls


def test_a_unit_reusing_a_query_in_flight_scores_as_in_serial_order(model_dirs, monkeypatch):
    """SECOND's forward reads the query pages FIRST's forward, still running, computes: its
    scores are those of the serial order, bit for bit (the same batches, the same programs)."""
    scores, events = {}, {}
    for depth in (1, 2):
        engine = engine_of_depth(model_dirs, depth)
        try:
            gate = GatedRunner(engine.runner, monkeypatch)
            first, second = second_behind_first(engine, gate)
            scores[depth] = [first.result(60).scores, second.result(60).scores]
            events[depth] = list(gate.events)
            assert gate.rows == [2, 3]
            assert engine.scheduler.stats.cached_tokens == 16  # SECOND reused two pages
            assert_no_leaked_pages(engine)
            monkeypatch.undo()
        finally:
            engine.close()
    assert events == {1: SERIAL, 2: PIPELINED}
    assert scores[1] == scores[2]


def test_a_fault_in_forward_n_reruns_the_forward_behind_it(model_dirs, monkeypatch,
                                                             answered_units):
    """FIRST's forward fails when collected, with SECOND's, which read FIRST's query pages,
    in flight behind it: FIRST fails, SECOND runs again on a clean pool and gets the scores
    it gets alone. Nothing is answered twice, no page leaks."""
    engine = engine_of_depth(model_dirs, 2)
    try:
        alone = engine.score_request(SECOND).scores
        engine.flush_prefix_cache()
        gate = GatedRunner(engine.runner, monkeypatch, fail=lambda call: call == 0)
        first, second = second_behind_first(engine, gate)
        with pytest.raises(ScoreError, match="injected fault in forward 0") as err:
            first.result(60)
        assert err.value.status == 500
        assert second.result(60).scores == alone
        assert gate.events == PIPELINED + ["dispatch 2", "collect 2"]
        assert gate.rows == [2, 3, 3]
        assert len(answered_units) == len(set(answered_units)) == 2  # alone, then the rerun
        assert engine.scheduler.stats.failed_forwards == 1
        assert_no_leaked_pages(engine)
    finally:
        engine.close()


def test_a_request_cancelled_in_flight_is_dropped_and_frees_its_pages(model_dirs, monkeypatch,
                                                                       answered_units):
    engine = engine_of_depth(model_dirs, 2)
    try:
        gate = GatedRunner(engine.runner, monkeypatch)
        first, second = second_behind_first(engine, gate)
        first.cancel()  # its forward is in flight: the answer is dropped
        assert len(second.result(60).scores) == 3
        assert gate.rows == [2, 3]
        assert len(answered_units) == 2 and first.cancelled()
        assert_no_leaked_pages(engine)
    finally:
        engine.close()


def test_close_with_forwards_in_flight_answers_or_fails_every_request(model_dirs, monkeypatch):
    engine = engine_of_depth(model_dirs, 2)
    gate = GatedRunner(engine.runner, monkeypatch)
    first = engine.submit(FIRST)
    assert gate.entered.wait(60)
    later = [engine.submit(parse_score_request(dict(query=[k] * 30, items=[[k]] * 12,
                                                    label_token_ids=[1])))
             for k in range(5, 10)]  # more than one forward's budget
    closing = threading.Thread(target=engine.close)
    closing.start()
    threading.Timer(0.2, gate.release.set).start()
    closing.join(60)
    assert not closing.is_alive()
    assert len(first.result(0).scores) == 2  # in flight: answered
    outcomes = collections.Counter()
    for future in later:
        try:
            outcomes[len(future.result(0).scores)] += 1
        except ScoreError as e:
            assert e.status == 503 and "shutting down" in e.message
            outcomes["503"] += 1
    assert sum(outcomes.values()) == 5 and outcomes["503"] >= 1, outcomes
    engine.check_pages()


def test_random_faults_and_cancellations_with_three_forwards_in_flight(model_dirs,
                                                                         monkeypatch):
    """Whatever fails or is cancelled, every other request is answered with its own scores
    (those it gets alone, within the shape tolerance) and every page comes back."""
    engine = Engine.from_path(model_dirs["qwen3"], small_config(
        max_prefill_tokens=32, max_seqs=2, max_rows=8, pipeline_depth=3))
    try:
        rng = np.random.default_rng(3)
        reqs = [parse_score_request(dict(
            query=rng.integers(0, 300, int(rng.integers(1, 24))).tolist(),
            items=[rng.integers(0, 300, int(n)).tolist() for n in rng.integers(1, 6, 3)],
            label_token_ids=[1, 2])) for _ in range(16)]
        want = [engine.score_request(r).scores for r in reqs]
        faults = rng.random(400) < 0.2
        gate = GatedRunner(engine.runner, monkeypatch, fail=lambda call: faults[call])
        gate.release.set()
        futures = [engine.submit(r) for r in reqs]
        futures[5].cancel()
        ok = 0
        for k, future in enumerate(futures):
            try:
                got = future.result(120).scores
            except (ScoreError, concurrent.futures.CancelledError) as e:
                assert k == 5 or "injected fault" in str(e)
                continue
            assert_scores_close(got, want[k])
            ok += 1
        assert ok >= 6 and engine.scheduler.stats.failed_forwards > 0
        assert_no_leaked_pages(engine)
    finally:
        engine.close()


def test_a_forward_is_counted_with_its_host_time(model_dirs, monkeypatch):
    """When a forward's first answer is given, the forward counter and the scheduler's host
    seconds have both moved for it: a reader of the two counters (the host-path benchmark's
    CPU time a forward) never sees forwards without their host time."""
    seen = []
    real = Job.unit_done

    def record(job, *args):
        stats = engine.scheduler.stats
        seen.append((stats.forwards, stats.host_s))
        return real(job, *args)
    engine = engine_of_depth(model_dirs, 2)
    monkeypatch.setattr(Job, "unit_done", record)
    try:
        for req in (FIRST, SECOND, FIRST):
            engine.submit(req).result(timeout=60)
    finally:
        engine.close()
    assert [forwards for forwards, _ in seen] == [1, 2, 3]
    host = [host_s for _, host_s in seen]
    assert 0 < host[0] < host[1] < host[2]
