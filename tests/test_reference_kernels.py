"""The reference kernels against direct NumPy readings of CONTRACT §3-§4."""
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.label_gather import final_norm_label_gather_reference
from kernels.ragged_paged_attention import (
    AttentionMetadata,
    page_blocks,
    ragged_paged_attention_reference,
    write_kv_pages,
)

LAYERS, HKV, HQ, D, PAGE, PAGES = 2, 2, 4, 16, 4, 24


def ragged_case(rng):
    """A causal sequence, a prefix-cached one (kv_len > q_len) and a multi-item one."""
    seqs = [dict(q_len=5, kv_len=5, prefix=0, vis=[0] * 5),
            dict(q_len=3, kv_len=9, prefix=0, vis=[0] * 3),
            dict(q_len=9, kv_len=9, prefix=4, vis=[0] * 4 + [4] * 3 + [7] * 2)]
    order = rng.permutation(PAGES)  # scrambled page tables
    tables, used = [], 0
    for s in seqs:
        n = -(-s["kv_len"] // PAGE)
        tables.append(order[used:used + n].tolist() + [0] * (3 - n))
        used += n
    return seqs, np.array(tables + [[0, 0, 0]], np.int32)  # plus one padding sequence


def logical(pos, prefix, vis):
    """A position as if the token's item followed the query directly (its own run alone)."""
    return pos if pos < prefix else prefix + (pos - vis)


def naive_attention(q, k_pages, v_pages, seqs, tables, layer, window=0, softcap=0.0):
    out, t = [], 0
    for s, table in zip(seqs, tables):
        kv = np.arange(s["kv_len"])
        k = k_pages[layer][:, table[kv // PAGE], kv % PAGE]  # [Hkv, kv_len, D]
        v = v_pages[layer][:, table[kv // PAGE], kv % PAGE]
        for i in range(s["q_len"]):
            pos = s["kv_len"] - s["q_len"] + i
            seen = (kv <= pos) & ((kv < s["prefix"]) | (kv >= s["vis"][i]))
            if window:
                me = logical(pos, s["prefix"], s["vis"][i])
                seen &= np.array([me - logical(j, s["prefix"], s["vis"][i]) < window
                                  for j in kv])
            for h in range(HQ):
                logits = k[h // (HQ // HKV)][seen] @ q[t, h] / np.sqrt(D)
                if softcap:
                    logits = softcap * np.tanh(logits / softcap)
                p = np.exp(logits - logits.max())
                out.append((p / p.sum()) @ v[h // (HQ // HKV)][seen])
            t += 1
    return np.array(out).reshape(t, HQ, D)


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (3, 0.0), (2, 1.5)])
def test_attention_reference_matches_mask_rule(window, softcap):
    """The multi-item mask; a sliding window by logical position (an item's tokens see the
    query's last keys as if the item followed it); soft-capped scores."""
    rng = np.random.default_rng(0)
    seqs, tables = ragged_case(rng)
    k_pages = rng.standard_normal((LAYERS, HKV, PAGES, PAGE, D)).astype(np.float32)
    v_pages = rng.standard_normal((LAYERS, HKV, PAGES, PAGE, D)).astype(np.float32)
    n_tokens = sum(s["q_len"] for s in seqs)
    q = rng.standard_normal((n_tokens + 3, HQ, D)).astype(np.float32)  # 3 padding tokens
    cu = np.cumsum([0] + [s["q_len"] for s in seqs] + [0]).astype(np.int32)
    md = AttentionMetadata(
        cu_q_lens=jnp.asarray(cu), kv_lens=jnp.array([s["kv_len"] for s in seqs] + [0]),
        page_indices=jnp.asarray(tables), shared_lens=jnp.array([s["prefix"] for s in seqs] + [0]),
        visible_from=jnp.array(sum((s["vis"] for s in seqs), []) + [0] * 3))
    got = ragged_paged_attention_reference(jnp.asarray(q), k_pages, v_pages, 1, md,
                                           sm_scale=D ** -0.5, max_q_len=16, q_block=8,
                                           softcap=softcap, window=jnp.int32(window))
    want = naive_attention(q, k_pages, v_pages, seqs, tables, 1, window, softcap)
    np.testing.assert_allclose(np.asarray(got)[:n_tokens], want, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_write_kv_pages_writes_whole_pages_and_drops_padding():
    k = jnp.zeros((LAYERS, HKV, PAGES, PAGE, D))
    new = jnp.arange(3 * HKV * PAGE * D, dtype=jnp.float32).reshape(3, HKV, PAGE, D) + 1
    pages = jnp.array([5, 2, PAGES])  # the last one is padding
    k2, v2 = write_kv_pages(k, k, 1, new, -new, pages)
    np.testing.assert_array_equal(k2[1, :, 5], new[0])
    np.testing.assert_array_equal(v2[1, :, 2], -new[1])
    assert float(jnp.abs(k2).sum()) == float(jnp.abs(new[:2]).sum())


def test_page_blocks_lay_tokens_out_as_pages():
    new = jnp.arange(5 * HKV * D, dtype=jnp.float32).reshape(5, HKV, D)
    page_tokens = jnp.array([[3, 4] + [4] * (PAGE - 2), list(range(PAGE))]) % 5
    blocks = page_blocks(new, page_tokens)
    assert blocks.shape == (2, HKV, PAGE, D)
    np.testing.assert_array_equal(blocks[0, :, 1], new[4])
    np.testing.assert_array_equal(blocks[1, :, 2], new[2])


def test_attention_rejects_bad_shapes():
    md = AttentionMetadata(jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32),
                           jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32),
                           jnp.zeros(4, jnp.int32))
    pages = jnp.zeros((1, 2, 4, PAGE, D))
    with pytest.raises(ValueError, match="GQA"):
        ragged_paged_attention_reference(jnp.zeros((4, 3, D)), pages, pages, 0, md,
                                         sm_scale=1.0, max_q_len=4)
    with pytest.raises(ValueError, match="metadata"):
        ragged_paged_attention_reference(jnp.zeros((5, 4, D)), pages, pages, 0, md,
                                         sm_scale=1.0, max_q_len=4)


def numpy_label_gather(hidden, norm_w, head, labels, eps):
    x = hidden / np.sqrt(np.mean(hidden ** 2, -1, keepdims=True) + eps) * norm_w
    logits = x @ head.T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return np.take_along_axis(logits, labels, 1), lse


@pytest.mark.parametrize("repeats", [1, 4])  # 4 labels read rows; 16 labels read the whole head
def test_label_gather_reference(repeats):
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((7, 32)).astype(np.float32)
    norm_w = rng.standard_normal(32).astype(np.float32)
    head = rng.standard_normal((301, 32)).astype(np.float32)
    labels = np.array([[0, 300, 5, 5] * repeats] * 7, np.int32)  # duplicates, the last row
    want, want_lse = numpy_label_gather(hidden, norm_w, head, labels, 1e-6)
    got, lse = final_norm_label_gather_reference(hidden, norm_w, head, labels, eps=1e-6,
                                                 with_logsumexp=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    only_labels, none = final_norm_label_gather_reference(
        hidden, norm_w, head, labels, eps=1e-6, with_logsumexp=False)
    assert none is None
    np.testing.assert_allclose(only_labels, got, rtol=1e-6)


def test_label_gather_rejects_bad_shapes():
    with pytest.raises(ValueError, match="disagree on H"):
        final_norm_label_gather_reference(jnp.zeros((2, 8)), jnp.zeros(8), jnp.zeros((10, 4)),
                                          jnp.zeros((2, 1), jnp.int32), eps=1e-6,
                                          with_logsumexp=False)
