"""Which waiting units a forward takes (CONTRACT §5): fair between large and small requests, or
first come, first served; the order is asserted, never timed. And a forward's scores, each
unit's own."""
import concurrent.futures

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.job import Job, Unit, forward_scores, label_scores
from runtime.request import parse_score_request
from runtime.wait_queue import WaitQueue
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.gated_runner import GatedRunner
from tests.tiny_models import small_config


def job_with_units(name: str, n: int) -> tuple[Job, list[Unit]]:
    job = Job(labels=[1], n_items=n, n_units=n, kind="label_softmax")
    return job, [Unit(job, seq=f"{name}{k}", items=range(k, k + 1)) for k in range(n)]


def names(queue: WaitQueue) -> list[str]:
    return [unit.seq for unit in queue.in_order()]


def forward_of_one(queue: WaitQueue, unit: Unit | None = None) -> None:
    """A forward that takes `unit` (default: the first in order) and nothing else."""
    queue.take(unit or queue.in_order()[0])
    queue.forward_formed()


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_requests_not_yet_served_go_in_arrival_order(policy):
    queue = WaitQueue(policy)
    for name, n in (("a", 2), ("b", 1), ("c", 2)):
        queue.add(*job_with_units(name, n))
    assert names(queue) == ["a0", "a1", "b0", "c0", "c1"] and len(queue) == 5


def test_fair_puts_the_least_recently_served_first():
    queue = WaitQueue("fair")
    big, big_units = job_with_units("big", 3)
    queue.add(big, big_units)
    forward_of_one(queue, big_units[0])
    queue.add(*job_with_units("small", 1))   # arrives while big's first forward runs
    assert names(queue) == ["small0", "big1", "big2"]
    forward_of_one(queue)
    assert names(queue) == ["big1", "big2"]
    queue.add(*job_with_units("late", 1))
    assert names(queue) == ["late0", "big1", "big2"]


def test_fair_gives_a_served_request_its_turn_back():
    queue = WaitQueue("fair")
    for name in ("a", "b"):
        queue.add(*job_with_units(name, 3))
    for expect in (["a0", "a1", "a2", "b0", "b1", "b2"], ["b0", "b1", "b2", "a1", "a2"],
                   ["a1", "a2", "b1", "b2"]):
        assert names(queue) == expect
        forward_of_one(queue)


def test_fcfs_keeps_arrival_order_whatever_was_served():
    queue = WaitQueue("fcfs")
    big, big_units = job_with_units("big", 2)
    queue.add(big, big_units)
    forward_of_one(queue, big_units[0])
    queue.add(*job_with_units("small", 1))
    assert names(queue) == ["big1", "small0"]


def test_units_put_back_go_first_in_the_order_they_were_taken():
    """A forward that did not run returns its units: each before its job's waiting units,
    their jobs before every other."""
    queue = WaitQueue("fcfs")
    a, a_units = job_with_units("a", 3)
    b, b_units = job_with_units("b", 1)
    queue.add(a, a_units)
    queue.add(b, b_units)
    taken = [a_units[0], a_units[1]]
    for unit in taken:
        queue.take(unit)
    queue.put_back(taken)
    assert names(queue) == ["a0", "a1", "a2", "b0"]
    queue.take(b_units[0])  # b's last unit: b leaves the queue, then comes back first
    queue.put_back([b_units[0]])
    assert names(queue) == ["b0", "a0", "a1", "a2"]


def test_units_leave_in_order_and_dropped_jobs_are_forgotten():
    queue = WaitQueue("fair")
    job, units = job_with_units("a", 2)
    queue.add(job, units)
    with pytest.raises(ValueError, match="in order"):
        queue.take(units[1])
    queue.drop(job)
    assert not queue and names(queue) == [] and list(queue) == []
    with pytest.raises(ValueError, match="schedule policy"):
        WaitQueue("lifo")


def request(query, n_items, **kw):
    return parse_score_request(dict(query=query, items=[[7 + k % 50] for k in range(n_items)],
                                    label_token_ids=[1, 2], **kw))


BIG = request(list(range(3, 23)), 40)  # 20 query tokens (2 full pages), 3 units of <= 16 rows


@pytest.mark.parametrize("policy, rows", [
    ("fair", [16, 3, 16, 8]),  # the small request takes the next forward
    ("fcfs", [16, 16, 11])])   # it waits for the big one's last unit
def test_a_small_request_behind_a_large_one(model_dirs, monkeypatch, policy, rows):
    engine = Engine.from_path(model_dirs["qwen3"], small_config(
        max_prefill_tokens=64, max_seqs=4, max_rows=16, schedule_policy=policy))
    try:
        gate = GatedRunner(engine.runner, monkeypatch)
        big = engine.submit(BIG)
        assert gate.entered.wait(60)  # the big request's first forward holds
        small = engine.submit(request([60, 61], 3))
        gate.release.set()
        concurrent.futures.wait([big, small], 60)
        assert gate.rows == rows
        assert engine.scheduler.stats.cached_tokens == 2 * 16  # units 2, 3 reused the query
        monkeypatch.undo()  # scored alone, in forwards of other shapes: the shape tolerance
        assert_scores_close(big.result().scores, engine.score_request(BIG).scores)
        assert_no_leaked_pages(engine)
    finally:
        engine.close()


def test_a_forwards_scores_are_each_units_own():
    """forward_scores computes runs of alike units in one call: each unit's scores equal, bit
    for bit, label_scores of its rows alone, whatever kind and labels its neighbours have."""
    rng = np.random.default_rng(3)
    units = [("label_softmax", 2, 3), ("label_softmax", 2, 1), ("vocab_probs", 2, 2),
             ("label_softmax", 5, 4), ("logits", 5, 2), ("label_softmax", 2, 9)]
    rows = sum(n for _, _, n in units)
    logits, lse = rng.normal(size=(rows + 3, 8)) * 4, rng.normal(size=rows + 3) + 6
    scores, row = forward_scores(logits, lse, units), 0
    assert len(scores) == len(units)
    for (kind, labels, n), got in zip(units, scores):
        alone = label_scores(logits[row:row + n, :labels].copy(), lse[row:row + n], kind)
        assert got.shape == (n, labels) and np.array_equal(got, alone), kind
        row += n
