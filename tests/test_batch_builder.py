"""Padded batches: the token buckets, the whole pages new K/V fill (derived in the program
from the batch's metadata), and the real counts the kernels loop over."""
import dataclasses

import jax
import numpy as np
import pytest

from kernels.ragged_paged_attention import written_pages
from model.batch import pack, unpack
from runtime.batch_builder import ScheduledSeq, build_batch
from runtime.buckets import ShapeBuckets, pages_needed
from runtime.packing import causal_sequence, multi_item_sequence

PAGE, NUM_PAGES = 8, 40
BUCKETS = ShapeBuckets(max_tokens=64, max_seqs=4, max_rows=8, max_labels=3, max_kv_len=64,
                       page_size=PAGE)


def test_new_tokens_fill_whole_pages_after_the_cached_ones():
    query = multi_item_sequence(list(range(20)), [[1, 2], [3, 4, 5]])  # 25 tokens
    entries = [ScheduledSeq(query, [7, 3, 9, 12], cached=16),  # 2 cached pages, 9 new tokens
               ScheduledSeq(causal_sequence([5] * 5), [30])]
    shape = BUCKETS.shape(9 + 5, 3, 2)
    batch = build_batch(entries, [[1, 2], [3], [4, 5, 6]], shape, PAGE)
    page_ids, page_tokens = map(np.asarray, jax.jit(written_pages, static_argnums=(1, 2))(
        batch.attention, PAGE, NUM_PAGES))
    assert len(page_ids) == len(page_tokens) == pages_needed(shape.tokens, PAGE) + shape.seqs
    assert list(page_ids[:3]) == [9, 12, 30]
    assert (page_ids[3:] == NUM_PAGES).all()  # padding: written nowhere
    # the query's tokens 16..24 are packed tokens 0..8; the causal prompt's are 9..13
    np.testing.assert_array_equal(page_tokens[0], range(8))
    np.testing.assert_array_equal(page_tokens[1], [8] * PAGE)  # the last token repeats
    np.testing.assert_array_equal(page_tokens[2], [9, 10, 11, 12, 13, 13, 13, 13])
    assert int(batch.num_rows) == 3 and int(batch.num_labels) == 3


@pytest.mark.parametrize("seed", range(4))
def test_every_new_token_lands_in_its_page_row(seed):
    """Random batches with cached pages: new token i of sequence s, at KV position
    cached + i, is row (cached + i) % PAGE of page page_table[s][(cached + i) // PAGE], and
    every page written is one of those."""
    rng = np.random.default_rng(seed)
    buckets = ShapeBuckets(max_tokens=256, max_seqs=6, max_rows=256, max_labels=1,
                           max_kv_len=128, page_size=PAGE)
    free, entries, where = list(rng.permutation(NUM_PAGES * 4)), [], {}
    for _ in range(int(rng.integers(1, 6))):
        n, cached = int(rng.integers(1, 30)), PAGE * int(rng.integers(0, 3))
        seq = causal_sequence(rng.integers(0, 100, cached + n).tolist())
        entries.append(ScheduledSeq(seq, [int(free.pop()) for _ in range(
            pages_needed(cached + n, PAGE))], cached=cached))
    labels = [[0] for e in entries for _ in e.seq.score_rows]
    shape = buckets.shape(sum(e.new_tokens for e in entries), len(labels), len(entries))
    batch = build_batch(entries, labels, shape, PAGE)
    page_ids, page_tokens = map(np.asarray, written_pages(batch.attention, PAGE,
                                                          NUM_PAGES * 4))
    for page, tokens in zip(page_ids, page_tokens):
        for row, t in enumerate(tokens):
            where.setdefault((int(page), row), int(t))
    offset = 0
    for e in entries:
        for i in range(e.new_tokens):
            position = e.cached + i
            assert where[(e.pages[position // PAGE], position % PAGE)] == offset + i
        offset += e.new_tokens
    real = page_ids[page_ids < NUM_PAGES * 4]
    assert set(real.tolist()) == {e.pages[p] for e in entries for p in range(
        e.cached // PAGE, pages_needed(len(e.seq.tokens), PAGE))}


def test_a_page_aligned_batch_pads_each_sequence_to_whole_pages():
    """Page-aligned (the TPU backends): each sequence's new tokens start on a page boundary
    of the batch and are padded to whole pages by tokens that see the shared ones and
    themselves; the batch names the page each block of tokens fills (-1 after the last
    sequence), the pages the same that written_pages finds; the scored rows move with their
    tokens, and budgets and buckets count the padding."""
    buckets = dataclasses.replace(BUCKETS, page_aligned=True)
    query = multi_item_sequence(list(range(20)), [[1, 2], [3, 4, 5]])  # 25 tokens
    entries = [ScheduledSeq(query, [7, 3, 9, 12], cached=16),  # 9 new tokens: 2 pages
               ScheduledSeq(causal_sequence([5] * 5), [30])]   # 5: 1 page
    assert [buckets.padded_tokens(e.new_tokens) for e in entries] == [16, 8]
    assert (BUCKETS.padded_tokens(9), buckets.token_budget) == (9, 64)
    shape = buckets.shape(16 + 8, 3, 2)
    batch = build_batch(entries, [[1, 2], [3], [4, 5, 6]], shape, PAGE, page_aligned=True)
    md = batch.attention
    assert list(md.cu_q_lens[:3]) == [0, 16, 24] and list(md.kv_lens[:2]) == [32, 8]
    assert list(batch.block_pages) == [9, 12, 30] + [-1] * (shape.tokens // PAGE - 3)
    np.testing.assert_array_equal(batch.tokens[:24], list(query.tokens[16:]) + [0] * 7
                                  + [5] * 5 + [0] * 3)
    np.testing.assert_array_equal(md.visible_from[9:16], range(25, 32))  # each sees itself
    np.testing.assert_array_equal(batch.positions[9:16], range(25, 32))
    assert list(batch.score_rows[:3]) == [21 - 16, 24 - 16, 16 + 4]
    page_ids = np.asarray(written_pages(md, PAGE, NUM_PAGES)[0])
    assert list(page_ids[page_ids < NUM_PAGES]) == [9, 12, 30]
    unaligned = build_batch(entries, [[1, 2], [3], [4, 5, 6]], shape, PAGE)
    assert unaligned.block_pages is None and list(unaligned.attention.cu_q_lens[:3]) == [
        0, 9, 14]
    with pytest.raises(ValueError, match="exceeds the budgets"):
        buckets.shape(buckets.token_budget + 1)


def _fields_by_definition(query: list, items: list[list], cached: int, pad: int):
    """Positions and visible_from of a sequence's tokens from `cached` on, then `pad`
    padding tokens, token by token: the query's token i at i, visible from 0; token j of an
    item starting at s at len(query) + j, visible from s; a padding token at KV position i at
    i, visible from i."""
    fields, start = [(i, 0) for i in range(len(query))], len(query)
    for item in items:
        fields += [(len(query) + j, start) for j in range(len(item))]
        start += len(item)
    fields += [(i, i) for i in range(start, start + pad)]
    return fields[cached:]


@pytest.mark.parametrize("page_aligned", [False, True])
def test_positions_and_visible_from_follow_each_token_s_part(page_aligned):
    """Random batches of packed sequences (with and without a query, empty items anywhere,
    causal prompts, cached pages): the batch's per-token fields, made a forward at a time,
    are the definition's."""
    rng = np.random.default_rng(int(page_aligned))
    buckets = dataclasses.replace(ShapeBuckets(max_tokens=1024, max_seqs=8, max_rows=128,
                                               max_labels=1, max_kv_len=256, page_size=PAGE),
                                  page_aligned=page_aligned)
    for _ in range(30):
        entries, want = [], []
        for _ in range(int(rng.integers(0, 7))):
            query = [1] * int(rng.choice([0, 3, 8, 21]))
            items = [[2] * int(rng.choice([0, 1, 5, 9])) for _ in range(rng.integers(1, 6))]
            if not query:  # an item is then its own prompt, which is never empty
                items = [item + [3] for item in items]
            if rng.random() < 0.3:  # a causal prompt: an item without a query
                query, items = [], [query + items[0] + [3]]
                seq = causal_sequence(items[0])
            else:
                seq = multi_item_sequence(query, items)
            cached = PAGE * int(rng.integers(0, max(seq.first_row, 0) // PAGE + 1))
            entries.append(ScheduledSeq(seq, list(range(pages_needed(len(seq.tokens), PAGE))),
                                        cached=cached))
            pad = -entries[-1].new_tokens % PAGE if page_aligned else 0
            want += _fields_by_definition(query, items, cached, pad)
        labels = [[0] for e in entries for _ in e.seq.score_rows]
        shape = buckets.shape(len(want), len(labels), len(entries))
        batch = build_batch(entries, labels, shape, PAGE, page_aligned=page_aligned)
        got = list(zip(batch.positions[:len(want)].tolist(),
                       batch.attention.visible_from[:len(want)].tolist()))
        assert got == want


def test_cached_tokens_must_be_whole_pages():
    seq = causal_sequence(list(range(12)))
    with pytest.raises(ValueError, match="not whole pages of 8"):
        build_batch([ScheduledSeq(seq, [1, 2], cached=4)], [[1]], BUCKETS.shape(8, 1, 1), PAGE)


def test_an_empty_batch_writes_nothing():
    batch = build_batch([], [], BUCKETS.shape(16), PAGE)
    page_ids, _ = written_pages(batch.attention, PAGE, NUM_PAGES)
    assert (np.asarray(page_ids) == NUM_PAGES).all() and int(batch.num_labels) == 0


def test_a_packed_batch_unpacks_in_a_program_to_the_same_arrays():
    query = multi_item_sequence(list(range(20)), [[1, 2], [3, 4, 5]])
    shape = BUCKETS.shape(25 + 5, 3, 2)
    batch = build_batch([ScheduledSeq(query, [7, 3, 9, 12]),
                         ScheduledSeq(causal_sequence([5] * 5), [30])],
                        [[1, 2], [3], [4, 5, 6]], shape, PAGE, True)
    like = build_batch([], [], shape, PAGE)
    got = jax.jit(lambda packed: unpack(packed, like))(pack(batch))
    assert jax.tree.structure(got) == jax.tree.structure(batch)
    for want, have in zip(jax.tree.leaves(batch), jax.tree.leaves(got)):
        assert have.dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(have, want)
    assert bool(got.with_logsumexp)
    with pytest.raises(ValueError, match=r"packed batch of shape \(3,\)"):
        unpack(np.zeros(3, np.int32), like)


def test_token_buckets_waste_at_most_a_fifth_from_256_tokens_and_a_third_below():
    sizes = ShapeBuckets(8192, 64, 256, 2, 8192, 16).token_sizes()
    assert sizes[:12] == (16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448)
    assert sizes[-5:] == (4096, 5120, 6144, 7168, 8192) and len(sizes) == 29
    for smaller, size in zip(sizes, sizes[1:]):
        waste = (size - smaller - 1) / size  # a batch of smaller + 1 tokens
        assert waste < (1 / 5 if smaller >= 256 else 1 / 3), (smaller, size)
    assert ShapeBuckets(300, 8, 8, 2, 300, 16).token_sizes()[-2:] == (256, 320)  # covers 300
