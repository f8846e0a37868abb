"""The Pallas ragged paged attention kernel (TPU interpret mode on CPU) and the planned XLA
path vs the reference."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.attention_plan import (
    FIRST,
    LAST,
    AttentionPlan,
    BlockSizes,
    build_plan,
    default_block_sizes,
    max_item_steps,
    visited_kv_blocks,
)
from kernels.ragged_paged_attention import (
    AttentionMetadata,
    ragged_paged_attention_reference,
    visible_mask,
)
from kernels.ragged_paged_attention_kernel import ragged_paged_attention, whole_block_steps
from kernels.ragged_paged_attention_xla import block_rows, ragged_paged_attention_xla
from model.decoder import pool_head_dim
from profiling.v6e.compile import SIZED_MODELS, WINDOWED_MODELS, compile_for_v6e, mosaic_kernels
from tests.attention_cases import random_batch
from tests.plan_reference import plan_steps


def plan_for(md, sizes, page_size=8):
    """The plan padded to the bounds of its shapes (the kernels see padding steps)."""
    return build_plan(md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, sizes,
                      page_size=page_size)


def with_item_steps(sizes, page_size):
    """`sizes` plus item steps of 8 tokens over windows of a page or 16 positions."""
    return dataclasses.replace(sizes, item_q_block=8, item_kv_block=max(page_size, 16))


xla_attention = jax.jit(ragged_paged_attention_xla,
                        static_argnames=("sm_scale", "max_q_len", "sizes"))


def run_both(q, k, v, md, sizes, interpret, layer=1):
    """`interpret`: TPU interpreter parameters for the Pallas kernel, "xla", or "xla_items"
    (the XLA loop with item steps added to `sizes`)."""
    page = k.shape[3]
    if interpret == "xla_items":
        interpret, sizes = "xla", with_item_steps(sizes, page)
    plan = jax.tree.map(jnp.asarray, plan_for(md, sizes, page_size=page))
    kw = dict(sm_scale=q.shape[-1] ** -0.5, max_q_len=int(np.diff(md.cu_q_lens).max()))
    # float32 dots, as the server's float32 programs (at the default, a GPU's are TF32)
    with jax.default_matmul_precision("float32"):
        if interpret == "xla":
            got = xla_attention(q, k, v, layer, md._replace(plan=plan), sizes=sizes, **kw)
        else:
            got = ragged_paged_attention(q, k, v, layer, md._replace(plan=plan), sizes=sizes,
                                         interpret=interpret, **kw)
        want = ragged_paged_attention_reference(q, k, v, layer, md, **kw)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


CASES = [  # (specs, hq, hkv, d, page_size, sizes, dtype)
    ([("items", 10, [5, 0, 9, 1, 3]), ("causal", 7)], 4, 2, 64, 8, BlockSizes(8, 16), jnp.float32),
    ([("cached", 13, 6), ("items", 3, [1, 1, 0, 12])], 2, 2, 128, 16, BlockSizes(8, 16), jnp.float32),
    ([("items", 9, [4] * 5), ("cached", 20, 3)], 8, 2, 64, 8, BlockSizes(16, 8), jnp.float32),
    ([("causal", 21), ("items", 6, [7, 2])], 4, 1, 128, 16, BlockSizes(8, 32), jnp.bfloat16),
    ([("items", 12, [17]), ("causal", 1)], 4, 4, 64, 8, BlockSizes(8, 16), jnp.bfloat16),
    ([("items", 4, [1, 0, 2, 1] * 16)], 4, 2, 64, 8, BlockSizes(16, 16), jnp.float32),  # 64 items
    ([("cached_items", 20, [3, 5, 2]), ("items", 7, [30, 2])], 4, 2, 64, 8, BlockSizes(8, 16),
     jnp.float32),  # item steps for the first sequence only: the second has a long item
]


def random_specs(rng):
    """Two or three sequences, each causal, prefix-cached, or a multi-item request."""
    specs = []
    for _ in range(int(rng.integers(2, 4))):
        kind = rng.choice(["causal", "cached", "items"])
        if kind == "causal":
            specs.append(("causal", int(rng.integers(1, 20))))
        elif kind == "cached":
            specs.append(("cached", int(rng.integers(1, 20)), int(rng.integers(1, 10))))
        else:
            items = rng.integers(0, 7, int(rng.integers(1, 6))).tolist()
            specs.append((str(rng.choice(["items", "cached_items"])), int(rng.integers(1, 12)),
                          items[:-1] + [items[-1] + 1]))
    return specs


@pytest.mark.parametrize("path", ["interpret", "xla", "xla_items"])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_reference_on_random_batches(seed, path):
    rng = np.random.default_rng(100 + seed)
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2, 4]))
    d, page = int(rng.choice([64, 128])), int(rng.choice([8, 16]))
    dtype = jnp.float32 if seed % 2 == 0 else jnp.bfloat16
    q, k, v, md, n = random_batch(rng, random_specs(rng), hq=hq, hkv=hkv, d=d, page_size=page,
                                  dtype=dtype)
    mode = pltpu.InterpretParams() if path == "interpret" else path
    got, want = run_both(q, k, v, md, BlockSizes(8, 2 * page), mode)
    assert not np.isnan(got[:n]).any()
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("path", ["interpret", "xla", "xla_items"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case, path):
    specs, hq, hkv, d, page, sizes, dtype = CASES[case]
    q, k, v, md, n = random_batch(np.random.default_rng(case), specs, hq=hq, hkv=hkv, d=d,
                                  page_size=page, dtype=dtype)
    mode = pltpu.InterpretParams() if path == "interpret" else path
    got, want = run_both(q, k, v, md, sizes, mode)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("path", ["interpret", "interpret_tiles", "xla", "xla_items"])
@pytest.mark.parametrize("case", [0, 6])
def test_window_and_softcap_match_reference(case, path):
    """A sliding window shorter than the queries, by logical position, and soft-capped scores,
    on the window's plan (the KV blocks and tiles it hides from every row skipped): the Pallas
    kernel (TPU interpreter) and the planned XLA loops as the reference."""
    specs, hq, hkv, d, page, sizes, dtype = CASES[case]
    q, k, v, md, n = random_batch(np.random.default_rng(case), specs, hq=hq, hkv=hkv, d=d,
                                  page_size=page, dtype=dtype)
    if path == "xla_items":
        sizes = with_item_steps(sizes, page)
    if path == "interpret_tiles":
        sizes = dataclasses.replace(sizes, tile=page)
    args = (md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, sizes)
    plan = build_plan(*args, page_size=page, window=4)  # a window's plan: fewer KV blocks
    full = int(build_plan(*args, page_size=page).num_steps)  # (case 6: its long item's)
    assert int(plan.num_steps) < full if case == 6 else int(plan.num_steps) <= full
    plan = jax.tree.map(jnp.asarray, plan)
    kw = dict(sm_scale=d ** -0.5, max_q_len=int(np.diff(md.cu_q_lens).max()), softcap=1.5,
              window=jnp.int32(4))
    attend = (functools.partial(ragged_paged_attention, interpret=pltpu.InterpretParams())
              if path.startswith("interpret") else ragged_paged_attention_xla)
    with jax.default_matmul_precision("float32"):
        got = attend(q, k, v, 1, md._replace(plan=plan), sizes=sizes, **kw)
        want = ragged_paged_attention_reference(q, k, v, 1, md, **kw)
        unwindowed = ragged_paged_attention_reference(q, k, v, 1, md, **{**kw, "window": None})
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=1e-5)
    assert np.abs(np.asarray(unwindowed)[:n] - np.asarray(want)[:n]).max() > 1e-2


@pytest.mark.parametrize("path", ["interpret", "xla", "xla_items"])
def test_padding_tokens_come_out_finite(path):
    """Blocks of padding only have no step; the interpreter fills memory nothing wrote with
    NaN, so an unwritten output would show. (Padding rows of a real block average junk.)"""
    q, k, v, md, n = random_batch(np.random.default_rng(3), [("items", 5, [3, 2])], hq=4,
                                  hkv=2, d=64, page_size=8, dtype=jnp.float32, pad_tokens=20)
    mode = pltpu.InterpretParams() if path == "interpret" else path
    got, want = run_both(q, k, v, md, BlockSizes(8, 8), mode)
    assert n < 16 and np.isfinite(got).all()
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5)


@pytest.mark.parametrize("items", [False, True])
def test_xla_block_steps_of_a_batch_smaller_than_a_q_block_take_its_rows(items):
    """All tokens in one q block: the block step scores the rows they fill (whole item
    blocks), not the q block's, and the output is the reference's."""
    q, k, v, md, n = random_batch(np.random.default_rng(5), [("items", 9, [4, 3]),
                                                             ("causal", 6)],
                                  hq=4, hkv=2, d=64, page_size=8, dtype=jnp.float32)
    sizes = with_item_steps(BlockSizes(64, 16), 8) if items else BlockSizes(64, 16)
    rows = block_rows(q.shape[0], sizes)
    assert rows == (32 if items else q.shape[0]) < sizes.q_block  # 27 tokens
    got, want = run_both(q, k, v, md, sizes, "xla")
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5)
    plan = jax.tree.map(jnp.asarray, plan_for(md, sizes, page_size=8))
    program = xla_attention.lower(q, k, v, 1, md._replace(plan=plan), sm_scale=0.125,
                                  max_q_len=q.shape[0], sizes=sizes)
    scores = set(re.findall(r"dot_general.*-> tensor<2x(\d+)x16xf32>", program.as_text()))
    assert scores == ({str(2 * rows), "16"} if items else {str(2 * rows)})  # 2 heads a group


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_kernel_has_no_dma_races(mode):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    q, k, v, md, n = random_batch(np.random.default_rng(9), [("items", 5, [3, 6]), ("cached", 9, 4)],
                                  hq=4, hkv=2, d=64, page_size=8, dtype=jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    got, want = run_both(q, k, v, md, BlockSizes(8, 8), params)
    assert not interpret_pallas_call.races.races_found
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5)


TILED_CASES = [  # (specs, hq, hkv, d, page_size, sizes, dtype): steps of 2 x 2 and 2 x 4 tiles
    ([("items", 30, [5, 0, 9, 1, 3]), ("causal", 7)], 4, 2, 64, 8, BlockSizes(16, 16, tile=8),
     jnp.float32),
    ([("cached_items", 20, [3, 5, 2] * 3), ("items", 7, [30, 2])], 4, 1, 128, 8,
     BlockSizes(16, 32, tile=8), jnp.bfloat16),
    ([("items", 12, [4] * 9), ("cached", 20, 3)], 8, 2, 64, 16, BlockSizes(32, 32, tile=16),
     jnp.float32),
]


@pytest.mark.parametrize("pages", ["shuffled", "consecutive", "mixed"])
@pytest.mark.parametrize("case", range(len(TILED_CASES)))
def test_kernel_with_tiles_matches_reference(case, pages):
    """Steps that skip the tiles no row sees: the reference's output, padding rows 0; a KV
    block whose pages follow each other comes in one copy, the others a page at a time
    ("mixed": one sequence's first two pages swapped)."""
    specs, hq, hkv, d, page, sizes, dtype = TILED_CASES[case]
    q, k, v, md, n = random_batch(np.random.default_rng(case), specs, hq=hq, hkv=hkv, d=d,
                                  page_size=page, dtype=dtype, pad_tokens=sizes.q_block,
                                  consecutive_pages=pages != "shuffled")
    if pages == "mixed":
        md = md._replace(page_indices=md.page_indices.at[0, :2].set(md.page_indices[0, 1::-1]))
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    plan = plan_for(md, sizes, page)
    live = [bin(int(b)).count("1") for b in plan.step_tiles[:int(plan.num_steps)]]
    assert min(live) >= 1 and sum(live) < np.prod(sizes.tiles()) * len(live)  # some skipped
    whole = whole_block_steps(plan, md, sizes, page, k.shape[2])  # the kernel's rule
    assert {"shuffled": whole < len(live), "consecutive": whole == len(live),
            "mixed": 0 < whole < len(live)}[pages]
    got, want = run_both(q, k, v, md, sizes, pltpu.InterpretParams(detect_races=True))
    assert not interpret_pallas_call.races.races_found
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5 if dtype == jnp.float32 else 2e-2)
    # in a q block with steps, tile rows of padding only, which no tile saw, are 0 (their
    # rows of the accumulator hold an earlier q block's sums)
    rows = np.arange(got.shape[0])
    stepped = np.isin(rows // sizes.q_block, plan.step_block[:int(plan.num_steps)])
    padding = stepped & (rows >= -(-n // sizes.tile) * sizes.tile)
    assert padding.any() or case == 2  # case 2's padding shares its tile rows with tokens
    assert (np.asarray(got)[padding] == 0).all()


def brute_force_tiles(md, plan, sizes):
    """Per real step, the bits of the tiles where some row of its segment sees a key."""
    bits = []
    n_rows, n_keys = sizes.tiles()
    for i in range(int(plan.num_steps)):
        b, s, kv = (int(x[i]) for x in (plan.step_block, plan.step_seq, plan.step_kv))
        tokens = np.arange(b * sizes.q_block, (b + 1) * sizes.q_block)
        tokens = tokens[tokens < len(plan.token_seq)]
        keys = kv * sizes.kv_block + np.arange(sizes.kv_block)
        seen = np.zeros((sizes.q_block, sizes.kv_block), bool)
        for t in tokens[plan.token_seq[tokens] == s]:
            seen[t - tokens[0]] = np.asarray(visible_mask(
                plan.token_pos[t:t + 1], md.visible_from[t:t + 1], int(md.shared_lens[s]),
                int(md.kv_lens[s]), keys))[0]
        tiles = seen.reshape(n_rows, sizes.tile, n_keys, sizes.tile).any(axis=(1, 3))
        bits.append(sum(1 << j for j, x in enumerate(tiles.ravel()) if x))
    return bits


@pytest.mark.parametrize("seed", range(6))
def test_step_tiles_are_the_tiles_some_row_sees(seed):
    """A tile's bit is set iff some row of the step's segment in it sees one of its keys: a
    set bit may cost work for nothing, a clear one would lose scores. The plan tests a tile
    by its rows' largest position and smallest visible-from, which can pass where no row
    sees anything (not in these batches: the bits are exact)."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([8, 16]))
    specs = random_specs(rng) + [("items", int(rng.integers(0, 70)),
                                  rng.integers(0, 30, int(rng.integers(1, 12))).tolist())]
    _, _, _, md, _ = random_batch(rng, specs, hq=1, hkv=1, d=8, page_size=page,
                                  dtype=jnp.float32)
    sizes = BlockSizes(2 * page, 2 * page * int(rng.integers(1, 3)), tile=page)
    plan = plan_for(md, sizes, page)
    want = brute_force_tiles(md, plan, sizes)
    got = plan.step_tiles[:int(plan.num_steps)].tolist()
    assert all(g & w == w for g, w in zip(got, want))  # every tile seen is marked
    assert got == want


def brute_force_blocks(md, sizes):
    """Per (q block, sequence) segment, the KV blocks that some row of it can see."""
    plan = plan_for(md, sizes)
    needed = {}
    for t in np.flatnonzero(plan.token_seq >= 0):
        s, b = int(plan.token_seq[t]), int(t) // sizes.q_block
        kv_pos = np.arange(int(md.kv_lens[s]))
        seen = np.asarray(visible_mask(plan.token_pos[t:t + 1], md.visible_from[t:t + 1],
                                       int(md.shared_lens[s]), int(md.kv_lens[s]), kv_pos))[0]
        needed.setdefault((b, s), set()).update(kv_pos[seen] // sizes.kv_block)
    return plan, {key: sorted(blocks) for key, blocks in needed.items()}


def plan_segments(plan):
    """The real steps' KV blocks per (q block, sequence) segment."""
    steps = {}
    for i in range(int(plan.num_steps)):
        key = (int(plan.step_block[i]), int(plan.step_seq[i]))
        steps.setdefault(key, []).append(int(plan.step_kv[i]))
    return steps


def test_sixty_four_items_visit_only_query_and_own_item_blocks():
    items = [18] * 64
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("items", 120, items)], hq=1,
                                  hkv=1, d=8, page_size=16, dtype=jnp.float32)
    sizes = BlockSizes(16, 16)
    plan, needed = brute_force_blocks(md, sizes)
    assert plan_segments(plan) == needed  # every visited block is seen by some row, no more
    total = 120 + 18 * 64
    q_blocks = -(-total // 16)
    dense_causal = q_blocks * (q_blocks + 1) // 2
    assert visited_kv_blocks(plan) == sum(map(len, needed.values())) < dense_causal / 4


@pytest.mark.parametrize("seed", range(4))
def test_plan_segments_are_in_token_order_and_visit_what_they_see(seed):
    """What both kernels rely on: q block b is tokens [b * q_block, (b + 1) * q_block), a
    block's steps are consecutive (FIRST on its first, LAST on its last), and each segment of
    a sequence in a block visits exactly the KV blocks its rows can see."""
    _, _, _, md, n = random_batch(np.random.default_rng(seed),
                                  random_specs(np.random.default_rng(seed)), hq=1, hkv=1, d=8,
                                  page_size=8, dtype=jnp.float32)
    sizes = BlockSizes(8, 16)
    plan, needed = brute_force_blocks(md, sizes)
    assert plan_segments(plan) == needed
    real = int(plan.num_steps)
    blocks, flags = plan.step_block[:real], plan.step_flags[:real]
    assert (np.diff(blocks) >= 0).all()
    starts = np.r_[True, np.diff(blocks) > 0]
    assert ((flags & FIRST) != 0).tolist() == starts.tolist()
    assert ((flags & LAST) != 0).tolist() == np.r_[starts[1:], True].tolist()
    assert (plan.token_seq[:n] >= 0).all() and (plan.token_seq[n:] == -1).all()


def covered_positions(plan, md, sizes, t):
    """The KV positions the steps show row t, with multiplicity: block steps below the
    sequence's split, item steps from it."""
    s = int(plan.token_seq[t])
    split = int(plan.kv_split[s])
    windows = [(int(plan.step_kv[i]) * sizes.kv_block, sizes.kv_block, True)
               for i in range(int(plan.num_steps))
               if plan.step_seq[i] == s and plan.step_block[i] == t // sizes.q_block]
    items = plan.items
    windows += [(int(items.start[i]), sizes.item_kv_block, False)
                for i in range(int(items.num_steps))
                if items.seq[i] == s and items.block[i] == t // sizes.item_q_block]
    cols = [c for start, width, below in windows for c in range(start, start + width)
            if (c < split) == below]
    return np.asarray(cols, int)


@pytest.mark.parametrize("seed", range(6))
def test_block_and_item_steps_show_each_visible_position_once(seed):
    """With item steps, every visible (row, KV position) pair is in exactly one step's window
    on that step's side of the split; short items' sequences have no block step past the
    query; the steps fit the bound a shape pads them to."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([8, 16]))
    specs = random_specs(rng)[:1] + [  # items of up to 24 tokens: some too long for windows
        (str(rng.choice(["items", "cached_items"])), int(rng.integers(1, 40)),
         rng.integers(1, 25, int(rng.integers(1, 8))).tolist()) for _ in range(2)]
    _, _, _, md, n = random_batch(rng, specs, hq=1, hkv=1, d=8, page_size=page,
                                  dtype=jnp.float32)
    sizes = with_item_steps(BlockSizes(16, 2 * page), page)
    plan = plan_for(md, sizes, page_size=page)
    for t in range(n):
        s = int(plan.token_seq[t])
        kv_pos = np.arange(int(md.kv_lens[s]) + 2 * sizes.kv_block)
        seen = np.asarray(visible_mask(plan.token_pos[t:t + 1], md.visible_from[t:t + 1],
                                       int(md.shared_lens[s]), int(md.kv_lens[s]), kv_pos))[0]
        counts = np.bincount(covered_positions(plan, md, sizes, t), minlength=len(kv_pos))
        assert (counts[seen] == 1).all(), (t, kv_pos[seen][counts[seen] != 1])
    for s, split in enumerate(plan.kv_split):
        if split < md.kv_lens[s]:
            assert split == md.shared_lens[s]
            real = np.arange(int(plan.num_steps))
            mine = real[plan.step_seq[real] == s]
            assert (plan.step_kv[mine] * sizes.kv_block < split).all()
    n_seqs = len(md.kv_lens)
    assert plan.items.num_steps <= max_item_steps(len(md.visible_from), n_seqs, page, sizes)


def test_item_steps_take_short_items_of_sglangs_shape():
    """120-token query, 10 items of 18 tokens, CPU's block sizes: the block steps stop at the
    query, one or two 32-wide windows serve each 16 item tokens."""
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("items", 120, [18] * 10)], hq=1,
                                  hkv=1, d=8, page_size=16, dtype=jnp.float32)
    sizes = default_block_sizes("xla cpu", 16)
    plan = plan_for(md, sizes, page_size=16)
    assert plan.kv_split.tolist() == [120]
    assert (plan.step_kv[:int(plan.num_steps)] == 0).all()
    item_blocks = range(120 // 16, 300 // 16 + 1)
    assert sorted(set(plan.items.block[:int(plan.items.num_steps)])) == list(item_blocks)
    assert len(item_blocks) <= plan.items.num_steps <= 2 * len(item_blocks)


@pytest.mark.parametrize("query, items, item_steps", [(50, [10] * 4, False),
                                                      (100, [14, 14], False),
                                                      (100, [15, 15], True)])
def test_item_steps_only_for_items_past_the_kv_block_the_query_ends_in(query, items,
                                                                       item_steps):
    """Items that end within the query's last KV block (128 positions on CPU), which their rows
    visit for the query anyway, go to the block step; past it, item steps take them."""
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("items", query, items)], hq=1,
                                  hkv=1, d=8, page_size=16, dtype=jnp.float32)
    sizes = default_block_sizes("xla cpu", 16)
    plan = plan_for(md, sizes, page_size=16)
    kv_len = query + sum(items)
    assert plan.kv_split.tolist() == [query if item_steps else kv_len]
    assert (plan.items.num_steps > 0) == item_steps
    assert set(plan.step_kv[:int(plan.num_steps)].tolist()) == {0}  # KV block 0 either way


def test_sequences_that_share_a_q_block_get_a_segment_each():
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("causal", 5), ("causal", 6)],
                                  hq=1, hkv=1, d=8, page_size=8, dtype=jnp.float32)
    plan = plan_for(md, BlockSizes(8, 8))
    assert plan_segments(plan) == {(0, 0): [0], (0, 1): [0], (1, 1): [0]}


def test_padding_steps_are_not_counted():
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("causal", 40)], hq=1, hkv=1, d=8,
                                  page_size=8, dtype=jnp.float32)
    plan = build_plan(md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from,
                      BlockSizes(8, 8), max_steps=16)
    assert len(plan.step_block) == 16 and visited_kv_blocks(plan) == 15  # 5 q blocks: 1+2+...+5
    assert plan.num_steps == 15


def test_plan_larger_than_its_padding_is_refused():
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("causal", 40)], hq=1, hkv=1, d=8,
                                  page_size=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="15 steps"):
        build_plan(md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, BlockSizes(8, 8),
                   max_steps=14)


@pytest.mark.parametrize("model, dtype, page", [
    ("SmolLM2-135M", jnp.bfloat16, 128), ("Qwen3-0.6B", jnp.float32, 16),
    ("Qwen2.5-0.5B", jnp.bfloat16, 16), ("Llama-3.2-1B", jnp.float32, 128),
    ("Gemma-2-2B", jnp.bfloat16, 128)])
def test_kernel_compiles_for_v6e(model, dtype, page):
    """Through Mosaic's compiler at the server's v6e block sizes and lane-aligned pool: each
    model's heads once, and each dtype with pages of 16 and of 128 (a tile's), Gemma 2's with
    its soft-cap and sliding window; 2-9 s each. The server's own programs (bfloat16, pages of
    16) compile for every sized model in tests/test_tpu_programs.py."""
    cfg = {**SIZED_MODELS, **WINDOWED_MODELS}[model]
    windowed = dict(softcap=cfg.attn_softcap, window=4096) if cfg.windowed else {}
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, pool_head_dim(cfg, "pallas")
    sizes = default_block_sizes("TPU v6 lite", page)
    t, s, p, ns = 1024, 4, 64, 64
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pages = sds((2, hkv, 64, page, d), dtype)
    md = AttentionMetadata(sds((s + 1,), i32), sds((s,), i32), sds((s, p), i32), sds((s,), i32),
                           sds((t,), i32))
    plan = AttentionPlan(*[sds((t,), i32)] * 2, *[sds((ns,), i32)] * 4, sds((), i32),
                         step_tiles=sds((ns,), i32) if sizes.tile else None)

    def fn(q, k, v, layer, md, plan):
        return ragged_paged_attention(q, k, v, layer, md._replace(plan=plan), sm_scale=0.1,
                                      max_q_len=t, sizes=sizes, **windowed)

    compiled = compile_for_v6e(fn, sds((t, hq, d), dtype), pages, pages, sds((), i32), md, plan)
    assert mosaic_kernels(compiled) == ["ragged_paged_attention"]


@pytest.mark.parametrize("seed", range(12))
def test_plan_equals_its_rule_segment_by_segment(seed):
    """build_plan's array operations give the steps, item steps and splits, in order, that
    the rule gives one segment at a time (tests/plan_reference.py)."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([8, 16]))
    specs = random_specs(rng) + [("items", int(rng.integers(0, 70)),
                                  rng.integers(0, 30, int(rng.integers(1, 12))).tolist())]
    specs.insert(int(rng.integers(0, len(specs) + 1)), ("causal", 0))  # a sequence of none
    _, _, _, md, _ = random_batch(rng, specs, hq=1, hkv=1, d=8, page_size=page,
                                  dtype=jnp.float32)
    sizes = BlockSizes(8 * int(rng.integers(1, 5)), page * int(rng.integers(1, 4)))
    if seed % 2:
        sizes = dataclasses.replace(sizes, item_q_block=8 * int(rng.integers(1, 3)),
                                    item_kv_block=page * int(rng.integers(1, 3)))
    window = int(rng.integers(1, 40)) if seed % 3 else 0  # a sliding window's plan
    args = (md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, sizes)
    plan = build_plan(*args, page_size=page, window=window)
    pos, seq, steps, item_steps, splits = plan_steps(*args, page_size=page, window=window)
    assert plan.token_pos.tolist() == pos and plan.token_seq.tolist() == seq
    real = int(plan.num_steps) if steps else 0
    got = np.stack([plan.step_block, plan.step_seq, plan.step_kv], 1)[:real]
    assert got.tolist() == [list(s) for s in steps]
    if sizes.item_q_block:
        items = plan.items
        got = np.stack([items.block, items.seq, items.start], 1)[:int(items.num_steps)]
        assert got.tolist() == [list(s) for s in item_steps]
        assert plan.kv_split.tolist() == splits
