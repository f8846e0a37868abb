"""Score requests' texts tokenized no more once seen twice (runtime.token_cache): the same ids
as the tokenizer's, the least recently used dropped past the capacity, safe across threads."""
import concurrent.futures

from runtime.token_cache import TokenCache, entry_bytes
from tests.assertions import assert_scores_close

TEXTS = ["Tokyo is a city", " in Japan", "", " in France", " in Japan", "Tokyo is a city"]


class CountingTokenizer:
    """A tokenizer's encode_pieces, counting the texts it tokenizes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []

    def encode_pieces(self, texts):
        self.texts += texts
        return self.tokenizer.encode_pieces(texts)


def test_the_ids_are_the_tokenizers_and_a_text_seen_twice_is_tokenized_no_more(engines):
    tokenizer = CountingTokenizer(engines["qwen3"].tokenizer)
    cache = TokenCache(tokenizer)
    expected = tokenizer.tokenizer.encode_pieces(TEXTS)
    for texts, ids in [(TEXTS, expected), (TEXTS[::-1], expected[::-1])] * 2:
        assert cache.encode_pieces(texts) == ids
    assert sorted(tokenizer.texts) == sorted([*set(TEXTS)] * 2)  # repeats in a call: once
    assert (cache.hits, cache.misses) == (4 * len(TEXTS) - 8, 8)


def test_each_answer_is_a_list_of_its_own(engines):
    cache = TokenCache(engines["qwen3"].tokenizer)
    first, again = cache.encode_pieces([" in Japan", " in Japan"])
    first.append(-1)
    assert again[-1] != -1 and cache.encode_pieces([" in Japan"]) == [again]


def test_the_least_recently_used_texts_go_first_past_the_capacity(engines):
    tokenizer = CountingTokenizer(engines["qwen3"].tokenizer)
    texts = [f"item number {k:03d}" for k in range(200)]
    costs = [entry_bytes(t, len(ids))
             for t, ids in zip(texts, tokenizer.tokenizer.encode_pieces(texts))]
    cache = TokenCache(tokenizer, capacity=64 * max(costs))
    assert sum(costs) > cache.capacity
    for text in texts:
        cache.encode_pieces([text])
        cache.encode_pieces([text])  # seen twice: kept
        cache.encode_pieces([texts[0]])  # the first text, always just used
    for text in (texts[-1], texts[1]):
        cache.encode_pieces([text])
    # the first kept throughout, the second dropped
    assert tokenizer.texts == [text for text in texts for _ in range(2)] + [texts[1]]


def test_a_text_over_a_64th_of_the_capacity_is_not_kept(engines):
    tokenizer = CountingTokenizer(engines["qwen3"].tokenizer)
    long_text = "a shelf of many words " * 40
    cache = TokenCache(tokenizer, capacity=64 * len(long_text))
    answers = [cache.encode_pieces([long_text, "short"]) for _ in range(3)]
    assert answers[0] == answers[1] == answers[2]
    assert tokenizer.texts == [long_text, "short", long_text, "short", long_text]


def test_threads_sharing_a_cache_get_the_tokenizers_ids(engines):
    tokenizer = engines["qwen3"].tokenizer
    cache = TokenCache(tokenizer, capacity=64 * 2000)  # small: threads evict each other's
    batches = [[f"item {k % 37} of shelf {k % 5}" for k in range(j, j + 30)] for j in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(cache.encode_pieces, batches))
    assert got == [tokenizer.encode_pieces(batch) for batch in batches]


def test_an_engine_tokenizes_a_shelf_once_with_the_same_scores(engines):
    engine = engines["qwen3"]
    query, shelf = "Query: a kitchen tool\nItem:", [" a sturdy rake", " a cheap whisk", " an atlas"]
    for seen in ("Query: a garden tool\nItem:", "Query: a toy\nItem:"):  # kept when seen twice
        engine.score(seen, shelf, [5, 17])
    hits, misses = engine.token_cache.hits, engine.token_cache.misses
    cached = engine.score(query, shelf[::-1], [5, 17])
    assert (engine.token_cache.hits - hits, engine.token_cache.misses - misses) == (3, 1)
    query_ids, *item_ids = engine.tokenizer.encode_pieces([query, *shelf[::-1]])
    assert_scores_close(cached.scores, engine.score(
        engine.tokenizer.start_ids + query_ids, item_ids, [5, 17]).scores, atol=1e-6)
