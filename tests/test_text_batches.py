"""Text requests of one turn of the event loop go to the engine together (server.text_batches,
Engine.submit_all): one call, the same scores as one by one, a bad request failing alone;
those that come while a batch is with the worker go together in the next."""
import asyncio
import concurrent.futures
import threading

import pytest

from runtime.errors import ScoreError
from runtime.request import parse_score_request
from server.text_batches import TextBatches
from tests.assertions import assert_scores_close

TEXT = [{"query": "Tokyo is a city", "items": [" in Japan", " in France"],
         "label_token_ids": [5, 17]},
        {"query": "Paris", "items": [" is large", " is small", " is old"],
         "label_token_ids": [3], "apply_softmax": True},
        {"query": "Rome", "items": [], "label_token_ids": [9]}]


def test_a_turns_text_requests_are_submitted_in_one_call_with_the_same_scores(engines):
    engine = engines["qwen3"]
    calls = []

    def submit_all(reqs):
        calls.append(len(reqs))
        return engine.submit_all(reqs)

    bad = {**TEXT[0], "label_token_ids": [engine.cfg.vocab_size]}  # outside the vocabulary
    ids = {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [3]}
    reqs = [parse_score_request(body) for body in [*TEXT, bad, ids]]

    async def turn():
        batches = TextBatches(submit_all)
        submitted = [batches.submit(req) for req in reqs]
        return await asyncio.gather(*submitted, return_exceptions=True)

    futures = asyncio.run(turn())
    assert calls == [len(reqs)]
    for body, future in zip([*TEXT, None, ids], futures, strict=True):
        if body is None:
            with pytest.raises(ScoreError, match="outside the vocabulary"):
                future.result(60)
        else:
            assert_scores_close(future.result(60).scores, engine.score(**body).scores,
                                atol=1e-6)


def test_requests_that_come_while_a_batch_is_tokenized_go_together_in_the_next():
    """One batch at a time with the worker: the three sent while the first is held go in one
    call after it, each request its own engine future."""
    release, calls = threading.Event(), []

    def submit_all(reqs):
        calls.append([req.query for req in reqs])
        if len(calls) == 1:
            release.wait(10)
        return [_resolved(req.query) for req in reqs]

    async def run():
        batches = TextBatches(submit_all)
        first = batches.submit(parse_score_request(TEXT[0]))
        while not calls:  # the first batch is with the worker
            await asyncio.sleep(0.001)
        rest = [batches.submit(parse_score_request({**TEXT[1], "query": q}))
                for q in ("a", "b", "c")]
        await asyncio.sleep(0.05)
        assert len(calls) == 1  # the three wait for the first
        release.set()
        return await asyncio.gather(first, *rest)

    futures = asyncio.run(run())
    assert calls == [[TEXT[0]["query"]], ["a", "b", "c"]]
    assert [f.result() for f in futures] == [TEXT[0]["query"], "a", "b", "c"]


def _resolved(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future
