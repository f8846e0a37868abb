"""The fused RMSNorm + label gather kernels (TPU interpret mode on CPU) and the row-blocked
XLA path vs the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.label_gather import final_norm_label_gather_reference, final_norm_label_gather_xla
from kernels.label_gather_kernel import final_norm_label_gather
from tests.tpu_lowering import tpu_export

CASES = [  # (rows, labels, vocab, with_logsumexp, dtype)
    (1, 1, 49152, True, jnp.float32), (7, 16, 151936, True, jnp.float32),
    (64, 128, 151669, True, jnp.float32), (64, 2, 49152, True, jnp.bfloat16),
    (1, 1, 49152, False, jnp.float32), (7, 2, 151936, False, jnp.float32),
    (64, 16, 151669, False, jnp.bfloat16), (1, 128, 49152, False, jnp.float32),
    (64, 128, 151936, False, jnp.float32),
]


def inputs(rng, rows, n_labels, vocab, dtype, width=32):
    hidden = jnp.asarray(rng.standard_normal((rows, width)), dtype)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(width), dtype)
    head = jnp.asarray(rng.standard_normal((vocab, width)), dtype)
    labels = rng.integers(0, vocab, (rows, n_labels))
    labels[:, -1] = vocab - 1  # the last row of the head: in the partial last tile
    labels[:, 0] = labels[:, -1]  # a duplicated label
    return hidden, norm, head, jnp.asarray(labels, jnp.int32)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case):
    rows, n_labels, vocab, with_lse, dtype = CASES[case]
    args = inputs(np.random.default_rng(case), rows, n_labels, vocab, dtype)
    kw = dict(eps=1e-6, with_logsumexp=with_lse, logit_scale=0.5)
    want = final_norm_label_gather_reference(*args, **kw)
    got = final_norm_label_gather(*args, **kw, vocab_tile=8192, interpret=pltpu.InterpretParams())
    assert got[0].dtype == jnp.float32 and got[0].shape == (rows, n_labels)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    assert (got[0][:, 0] == got[0][:, -1]).all()
    if with_lse:
        assert got[1].shape == (rows,)
        np.testing.assert_allclose(got[1], want[1], rtol=tol, atol=tol)
    else:
        assert got[1] is None


def test_softcap_matches_reference():
    args = inputs(np.random.default_rng(5), 8, 4, 3000, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=True, softcap=2.0)
    want = final_norm_label_gather_reference(*args, **kw)
    got = final_norm_label_gather(*args, **kw, vocab_tile=1024, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("num_rows", [0, 5, 16, 37, 64])
def test_xla_path_computes_the_first_rows(num_rows, with_lse):
    args = inputs(np.random.default_rng(num_rows), 64, 3, 5000, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=with_lse, softcap=3.0)
    want = final_norm_label_gather_reference(*args, **kw)
    got = jax.jit(final_norm_label_gather_xla,
                  static_argnames=("eps", "with_logsumexp", "softcap", "row_block"))(
        *args, **kw, num_rows=num_rows, row_block=16)
    np.testing.assert_allclose(got[0][:num_rows], want[0][:num_rows], rtol=1e-5, atol=1e-5)
    skipped = -(-num_rows // 16) * 16  # whole row blocks past num_rows are not computed
    assert not np.asarray(got[0][skipped:]).any()
    if with_lse:
        np.testing.assert_allclose(got[1][:num_rows], want[1][:num_rows], rtol=1e-5, atol=1e-5)
    else:
        assert got[1] is None


QWEN3 = dict(rows=64, vocab=151936, width=1024)


def shapes(rows, vocab, width, n_labels=2, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return (sds((rows, width), dtype), sds((width,), dtype), sds((vocab, width), dtype),
            sds((rows, n_labels), jnp.int32))


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("vocab, width", [(151936, 1024), (49152, 576), (151669, 896)])
def test_kernel_lowers_for_tpu(with_lse, vocab, width):
    mlir = tpu_export(lambda *a: final_norm_label_gather(*a, eps=1e-6, with_logsumexp=with_lse),
                      *shapes(64, vocab, width))
    assert "tpu_custom_call" in mlir


@pytest.mark.parametrize("with_lse", [True, False])
def test_kernel_path_holds_no_rows_by_vocab_buffer(with_lse):
    full = f"tensor<{QWEN3['rows']}x{QWEN3['vocab']}x"
    kernel = tpu_export(lambda *a: final_norm_label_gather(*a, eps=1e-6, with_logsumexp=with_lse),
                        *shapes(**QWEN3))
    assert "tpu_custom_call" in kernel and full not in kernel
    reference = tpu_export(
        lambda *a: final_norm_label_gather_reference(*a, eps=1e-6, with_logsumexp=True),
        *shapes(**QWEN3))
    assert full in reference


def test_streamed_mode_over_several_row_blocks():
    args = inputs(np.random.default_rng(6), 20, 3, 5000, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=True)
    want = final_norm_label_gather_reference(*args, **kw)
    got = final_norm_label_gather(*args, **kw, vocab_tile=1024, max_stream_rows=8,
                                  interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
