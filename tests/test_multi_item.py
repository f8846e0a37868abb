"""Multi-item packing (CONTRACT §4) computes exactly what one prompt per item computes."""
import numpy as np
import pytest

from runtime.engine import Engine
from runtime.errors import ScoreError
from runtime.packing import causal_sequence, item_chunks, multi_item_sequence
from runtime.request import parse_score_request
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.tiny_models import VOCAB, small_config

TEXT_ITEMS = ["", "a", " Paris", " the flag of Tokyo is a city in Japan", "🙂", "", " 123"]


def one_by_one(engine, query, items, labels, **kw):
    return [engine.score(query, [item], labels, **kw).scores[0] for item in items]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_cls"])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_items_packed_equal_single(engines, family, item_first):
    eng = engines[family]
    packed = eng.score("Answer Yes or No:", TEXT_ITEMS, [3, 4, 9], item_first=item_first)
    single = one_by_one(eng, "Answer Yes or No:", TEXT_ITEMS, [3, 4, 9], item_first=item_first)
    assert_scores_close(packed.scores, single)


@pytest.mark.parametrize("seed", range(4))
def test_random_token_items_packed_equal_single(engines, seed):
    rng = np.random.default_rng(seed)
    query = rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist()
    items = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(0, 12, 16)]
    labels = rng.integers(0, VOCAB, 5).tolist()
    eng = engines["qwen3"]
    for apply_softmax in (False, True):
        packed = eng.score(query, items, labels, apply_softmax=apply_softmax)
        single = one_by_one(eng, query, items, labels, apply_softmax=apply_softmax)
        assert_scores_close(packed.scores, single)
    assert packed.prompt_tokens == len(query) + sum(map(len, items))


@pytest.mark.parametrize("item_first", [False, True])
def test_an_empty_or_too_long_prompt_is_refused_naming_its_first_item(engines, item_first):
    """Refused as the request is taken apart (Engine.prepare), before any of it queues: a
    prompt that fits no forward would wait for one forever."""
    eng = engines["qwen3"]
    limit = eng.max_prompt_tokens

    def prepare(query, items):
        return eng.prepare(parse_score_request(dict(query=query, items=items, label_token_ids=[1],
                                                    item_first=item_first), True))
    with pytest.raises(ScoreError, match=r"the prompt of items\[1\] is empty"):
        prepare([], [[1], [], []])
    with pytest.raises(ScoreError, match=rf"the prompt of items\[2\] has {limit + 1} tokens, "
                                         rf"more than the maximum of {limit}"):
        prepare([1, 2], [[1], [3] * (limit - 2), [3] * (limit - 1), [4] * limit, []])
    assert len(eng.score([1], [[2] * (limit - 1), []], [1], item_first=item_first).scores) == 2


def test_chunked_request_equals_unchunked(model_dirs, engines):
    small = Engine.from_path(model_dirs["qwen2"], small_config(
        page_size=4, max_prefill_tokens=32, max_seqs=2, max_rows=32))
    rng = np.random.default_rng(1)
    query = rng.integers(0, VOCAB, 10).tolist()
    items = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 9, 20)]
    for item_first in (False, True):
        big = engines["qwen2"].score(query, items, [1, 2], item_first=item_first)
        chunked = small.score(query, items, [1, 2], item_first=item_first)
        assert_scores_close(chunked.scores, big.scores)
    assert_no_leaked_pages(small)
    small.close()


def test_a_request_longer_than_the_context_is_cut_where_each_prompt_fits(model_dirs, engines):
    """Items whose prompts each fit the model's context (256 positions) but not all packed
    together, with a forward budget larger than the context: units of at most 256 tokens,
    each KV sequence within the page table."""
    roomy = Engine.from_path(model_dirs["qwen3"], small_config(max_prefill_tokens=512))
    rng = np.random.default_rng(2)
    query = rng.integers(0, VOCAB, 100).tolist()
    items = [rng.integers(0, VOCAB, 20).tolist() for _ in range(10)]  # 300 tokens packed
    try:
        got = roomy.score(query, items, [1, 2])
        assert_scores_close(got.scores, engines["qwen3"].score(query, items, [1, 2]).scores)
        assert_no_leaked_pages(roomy)
    finally:
        roomy.close()


def test_multi_item_sequence_layout():
    seq = multi_item_sequence([10, 11, 12], [[20, 21], [], [30]])
    assert seq.tokens.tolist() == [10, 11, 12, 20, 21, 30]
    assert seq.positions.tolist() == [0, 1, 2, 3, 4, 3]
    assert seq.visible_from.tolist() == [0, 0, 0, 3, 3, 5]
    assert seq.shared_len == 3
    assert seq.score_rows.tolist() == [4, 2, 5]
    assert seq.cacheable == 3  # the query's K/V are a causal prompt's; the items' are not
    assert seq.first_row == 2  # the empty item's row: the query's last token


def test_without_a_query_the_first_item_is_a_causal_prompt():
    seq = multi_item_sequence([], [[20, 21], [30]])
    assert seq.positions.tolist() == [0, 1, 0] and seq.visible_from.tolist() == [0, 0, 2]
    assert seq.cacheable == 2


def _plain_prefix_len(seq) -> int:
    """The definition: leading tokens at position i, visible from 0 (a causal prompt's)."""
    plain = (seq.positions == np.arange(len(seq.tokens))) & (seq.visible_from == 0)
    return len(plain) if plain.all() else int(plain.argmin())


@pytest.mark.parametrize("seed", range(4))
def test_packed_sequences_say_their_cacheable_prefix_and_first_row(seed):
    """multi_item_sequence works both out from the item lengths, as the per-token fields
    define them, with or without a query and with empty items anywhere."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        query = rng.integers(0, VOCAB, rng.choice([0, 1, 7])).tolist()
        items = [rng.integers(0, VOCAB, rng.choice([0, 0, 1, 3])).tolist()
                 for _ in range(rng.integers(0, 5))]
        seq = multi_item_sequence(query, items)
        assert seq.cacheable == _plain_prefix_len(seq), (query, items)
        assert seq.first_row == min(seq.score_rows.tolist(), default=len(seq.tokens))
    seq = causal_sequence([5, 6, 7])
    assert (seq.cacheable, seq.first_row) == (3, 2) == (_plain_prefix_len(seq), 2)


def test_item_chunks_respect_budget():
    assert item_chunks(4, [3, 3, 3, 10], 10, 8) == [range(0, 2), range(2, 3), range(3, 4)]
    assert item_chunks(4, [0] * 5, 10, max_items=2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert item_chunks(4, [], 10, 8) == []


def test_many_empty_items_are_split_by_rows(model_dirs):
    eng = Engine.from_path(model_dirs["llama"], small_config(max_prefill_tokens=64, max_rows=16))
    got = eng.score("a query", [""] * 50 + ["x"], [1, 2])
    alone = eng.score("a query", [""], [1, 2]).scores[0]
    assert len(got.scores) == 51
    assert_scores_close(got.scores[:50], [alone] * 50)
    assert_no_leaked_pages(eng)
    eng.close()
