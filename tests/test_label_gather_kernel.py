"""The fused RMSNorm + label gather kernels (TPU interpret mode on CPU, and compiled for TPU
v6e) and the row-blocked XLA path vs the reference."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.label_gather import (
    ROW_BLOCK,
    TAIL_BLOCKS,
    final_norm_label_gather_reference,
    final_norm_label_gather_xla,
)
from kernels.label_gather_kernel import (
    final_norm_label_gather,
    label_runs,
    label_tiles_pay,
)
from profiling.v6e.compile import compile_for_v6e, mosaic_kernels

CASES = [  # (rows, labels, vocab, with_logsumexp, dtype)
    (1, 1, 49152, True, jnp.float32), (7, 16, 151936, True, jnp.float32),
    (64, 128, 49157, True, jnp.float32),  # a last vocabulary tile of 5 rows
    (64, 2, 49152, True, jnp.bfloat16),
    (1, 1, 49152, False, jnp.float32), (7, 2, 151936, False, jnp.float32),
    (64, 16, 151669, False, jnp.bfloat16), (1, 128, 49152, False, jnp.float32),
    (16, 128, 151936, False, jnp.float32),
    (64, 128, 49152, False, jnp.float32),  # tiles would outweigh the head: streamed instead
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
    kw = dict(eps=1e-6, with_logsumexp=with_lse)
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


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("num_rows", [0, 1, 3, 16, 17, 40, 48, 49, 100, 250])  # each branch
def test_xla_path_computes_the_first_rows(num_rows, with_lse):
    args = inputs(np.random.default_rng(num_rows), 300, 3, 5000, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=with_lse)
    with jax.default_matmul_precision("float32"):  # a GPU's default would round to TF32
        want = final_norm_label_gather_reference(*args, **kw)
        got = jax.jit(final_norm_label_gather_xla, static_argnames=("eps", "with_logsumexp"))(
            *args, **kw, num_rows=num_rows)
    np.testing.assert_allclose(got[0][:num_rows], want[0][:num_rows], rtol=1e-5, atol=1e-5)
    skipped = -(-num_rows // ROW_BLOCK) * ROW_BLOCK  # whole row blocks past num_rows: not computed
    assert not np.asarray(got[0][skipped:]).any()
    if with_lse:
        np.testing.assert_allclose(got[1][:num_rows], want[1][:num_rows], rtol=1e-5, atol=1e-5)
    else:
        assert got[1] is None


@pytest.mark.parametrize("rows", [16, 24, ROW_BLOCK])
def test_xla_path_with_one_row_block_computes_it_in_the_switch_only(rows):
    """Buckets up to ROW_BLOCK rows have one block of rows. A loop over whole blocks would slice
    the same rows on every trip, and XLA hoisted that block's head dot out of the loop, to run even
    at 0 trips (a third of a 16-token forward's time on CPU). XLA's own count of the program's
    FLOPs must be that of one block at most (a switch counts as its largest branch)."""
    args = inputs(np.random.default_rng(rows), rows, 3, 5000, jnp.float32)
    compiled = jax.jit(final_norm_label_gather_xla, static_argnames=("eps", "with_logsumexp")
                       ).lower(*args, eps=1e-6, with_logsumexp=True, num_rows=1).compile()
    block_flops = 2 * rows * args[0].shape[1] * args[2].shape[0]
    assert compiled.cost_analysis()["flops"] < 1.2 * block_flops


def test_xla_path_has_three_block_sizes_whatever_the_rows():
    """Each block size is code of its own, about 0.4 s of a CPU program's compile: one row,
    the tail block and the loop's block, and no more however many rows a bucket has."""
    args = inputs(np.random.default_rng(0), 256, 3, 5000, jnp.float32)
    compiled = jax.jit(final_norm_label_gather_xla, static_argnames=("eps", "with_logsumexp")
                       ).lower(*args, eps=1e-6, with_logsumexp=True, num_rows=1).compile()
    head_dots = re.findall(r"= f32\[5000,(\d+)\]\{[^}]*\} dot\(", compiled.as_text())
    assert sorted(map(int, head_dots)) == sorted([*TAIL_BLOCKS, ROW_BLOCK])


@pytest.mark.parametrize("with_lse", [True, False])
def test_padded_rows_and_labels_are_skipped(with_lse):
    """Only the first num_rows rows and num_labels labels are real; the rest come back 0."""
    args = inputs(np.random.default_rng(7), 20, 5, 4096, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=with_lse)
    want = final_norm_label_gather_reference(*args, **kw)
    got = final_norm_label_gather(*args, **kw, num_rows=11, num_labels=3, vocab_tile=1024,
                                  interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got[0][:11, :3], want[0][:11, :3], rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[0][:, 3:]).any()
    if not with_lse:  # label tiles: whole row blocks past num_rows are not computed
        assert not np.asarray(got[0][16:]).any()


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_label_tiles_have_no_dma_races(mode):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    args = inputs(np.random.default_rng(8), 9, 3, 2048, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=False)
    want = final_norm_label_gather_reference(*args, **kw)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    got = final_norm_label_gather(*args, **kw, interpret=params)
    assert not interpret_pallas_call.races.races_found
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_label_tiles_pay_while_fewer_than_the_head():
    assert label_tiles_pay(64, 2, 151936)          # 64 runs: 1024 head rows instead of 151936
    assert not label_tiles_pay(256, 128, 151936)   # 262144 rows of tiles: stream it instead
    assert not label_tiles_pay(64, 128, 49152)


def test_label_runs_number_consecutive_rows_with_the_same_labels():
    labels = jnp.asarray([[5, 9], [5, 9], [5, 8], [5, 9], [5, 9], [0, 0], [7, 7]], jnp.int32)
    assert label_runs(labels, 7).tolist() == [0, 0, 1, 2, 2, 3, 4]
    assert label_runs(labels, 4).tolist() == [0, 0, 1, 2, 2, 2, 2]  # padding stays in the last


@pytest.mark.parametrize("rows, n_labels, run_rows, row_block", [
    (40, 20, 7, 256),    # 6 runs x 20 labels: 15 chunks, more labels than a chunk has tiles
    (300, 2, 1, 128),    # every row its own run, over three row blocks (4800 tiles' rows)
    (64, 3, 64, 256),    # one run: one chunk
])
def test_label_tiles_over_many_runs_and_chunks(rows, n_labels, run_rows, row_block):
    rng = np.random.default_rng(rows)
    hidden, norm, head, _ = inputs(rng, rows, n_labels, 8192, jnp.float32)
    labels = rng.integers(0, 8192, (rows, n_labels))
    labels[-1, 0] = 8191  # in the head's last tile
    labels = jnp.asarray(labels[np.arange(rows) // run_rows * run_rows], jnp.int32)
    assert label_tiles_pay(-(-rows // run_rows), n_labels, 8192)  # not the streamed kernel
    kw = dict(eps=1e-6, with_logsumexp=False)
    want = final_norm_label_gather_reference(hidden, norm, head, labels, **kw)[0]
    got = final_norm_label_gather(hidden, norm, head, labels, **kw, max_label_rows=row_block,
                                  interpret=pltpu.InterpretParams())[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def shapes(rows, vocab, width, n_labels=2, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return (sds((rows, width), dtype), sds((width,), dtype), sds((vocab, width), dtype),
            sds((rows, n_labels), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("vocab, width", [(151936, 1024), (49152, 576), (151936, 896),
                                          (128256, 2048), (151669, 896), (256000, 2304)])
def test_kernel_compiles_for_v6e(with_lse, vocab, width, dtype):
    """The whole grid (the four models' heads, Gemma 2's with its final soft-cap, an odd
    vocabulary, both modes and dtypes) through Mosaic's compiler: a few tenths of a second
    each. Real rows and labels are runtime data, as in the server."""
    softcap = 30.0 if vocab == 256000 else 0.0

    def gather(hidden, norm, head, labels, num_rows, num_labels):
        return final_norm_label_gather(hidden, norm, head, labels, eps=1e-6,
                                       with_logsumexp=with_lse, num_rows=num_rows,
                                       num_labels=num_labels, softcap=softcap)

    count = jax.ShapeDtypeStruct((), jnp.int32)
    compiled = compile_for_v6e(gather, *shapes(64, vocab, width, dtype=dtype), count, count)
    tiles = not with_lse and vocab % 8 == 0  # both kernels, chosen at run time
    assert mosaic_kernels(compiled) == (["label_gather_rows", "label_gather_streamed"] if tiles
                                        else ["label_gather_streamed"])


@pytest.mark.parametrize("vocab, width, dtype, n_labels", [
    (128256, 8192, jnp.bfloat16, 64), (128256, 16384, jnp.bfloat16, 64),
    (128256, 8192, jnp.float32, 64), (151936, 1024, jnp.bfloat16, 256)])
def test_largest_block_fits_vmem_wide_or_with_many_labels(vocab, width, dtype, n_labels):
    """256 rows (the default --max-rows) and --max-labels labels, at 70B- and 405B-class
    widths: Mosaic refuses a kernel whose VMEM passes the 32 MiB scoped limit (hidden 8192
    needed 37.7 MiB before the norm went by row chunks and the head tiles halved; 256 labels,
    75 MiB before the streamed kernel took 64 at a time). Labels only: both kernels compile."""
    compiled = compile_for_v6e(
        lambda *a: final_norm_label_gather(*a, eps=1e-6, with_logsumexp=False),
        *shapes(256, vocab, width, n_labels, dtype))
    assert mosaic_kernels(compiled) == ["label_gather_rows", "label_gather_streamed"]


def test_compiled_kernels_hold_no_rows_by_vocab_buffer():
    full = "f32[64,151936]"
    for with_lse in (True, False):
        kernel = compile_for_v6e(
            lambda *a: final_norm_label_gather(*a, eps=1e-6, with_logsumexp=with_lse),
            *shapes(64, 151936, 1024))
        assert full not in kernel.as_text()
    reference = compile_for_v6e(
        lambda *a: final_norm_label_gather_reference(*a, eps=1e-6, with_logsumexp=True),
        *shapes(64, 151936, 1024))
    assert full in reference.as_text()


def test_streamed_mode_over_several_row_blocks():
    args = inputs(np.random.default_rng(6), 20, 3, 5000, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=True)
    want = final_norm_label_gather_reference(*args, **kw)
    got = final_norm_label_gather(*args, **kw, vocab_tile=1024, max_stream_rows=8,
                                  interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_labels", [5, 3, 2])
def test_streamed_mode_in_label_groups(num_labels):
    """5 label slots in groups of 2: a group past the real labels skips the head and gives 0."""
    args = inputs(np.random.default_rng(num_labels), 20, 5, 5000, jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=True)
    want = final_norm_label_gather_reference(*args, **kw)
    got = final_norm_label_gather(*args, **kw, num_labels=num_labels, vocab_tile=1024,
                                  max_stream_labels=2, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got[0][:, :num_labels], want[0][:, :num_labels], rtol=1e-5,
                               atol=1e-5)
    assert not np.asarray(got[0][:, num_labels:]).any()
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_lse, n_labels", [(True, 3), (False, 3), (False, 128)])
def test_final_softcap_caps_the_logits_before_the_logsumexp(with_lse, n_labels):
    """Gemma 2's final soft-cap, in the streamed kernel (before its logsumexp) and on the
    label tiles' logits, with a float32 norm weight (Gemma's 1 + w): the kernels, the XLA path
    and the reference agree, and the cap changes the answer."""
    hidden, norm, head, labels = inputs(np.random.default_rng(5), 8, n_labels, 4096,
                                        jnp.float32)
    norm = norm.astype(jnp.float32)
    kw = dict(eps=1e-6, with_logsumexp=with_lse, softcap=3.0)
    want = final_norm_label_gather_reference(hidden, norm, head, labels, **kw)
    got = final_norm_label_gather(hidden, norm, head, labels, **kw, vocab_tile=1024,
                                  interpret=pltpu.InterpretParams())
    xla = final_norm_label_gather_xla(hidden, norm, head, labels, **kw, num_rows=8)
    for path in (got, xla):
        np.testing.assert_allclose(path[0], want[0], rtol=1e-5, atol=1e-5)
        if with_lse:
            np.testing.assert_allclose(path[1], want[1], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want[0])).max() < 3.0
    uncapped = final_norm_label_gather_reference(hidden, norm, head, labels,
                                                 **{**kw, "softcap": 0.0})
    assert np.abs(np.asarray(uncapped[0])).max() > 3.0
