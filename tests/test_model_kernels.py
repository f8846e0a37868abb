"""The whole model on the planned XLA path and on the Pallas kernels (TPU interpret mode)
equals the dense reference path."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention_plan import BlockSizes
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from tests.assertions import assert_scores_close
from tests.tiny_models import small_config


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_cls"])
def test_model_on_planned_paths_equals_reference_path(model_dirs, engines, family):
    """The XLA loop on each family; the Pallas kernels (TPU interpreter) where their operands
    differ (Llama's heads pad to the same 128 lanes as Qwen3's; the classifier's head has 3
    rows), and the XLA loop with a GPU's block sizes on one family (an engine here compiles
    three programs, 3 to 7 s each)."""
    def engine(**overrides):
        return Engine.from_path(model_dirs[family], small_config(**overrides))
    planned = [engines[family]]
    if family != "llama":
        planned.append(engine(kernel_backend="interpret", q_block=8, kv_block=16))
    if family == "qwen3":
        planned.append(engine(q_block=512, kv_block=1024))
    reference = engine(kernel_backend="reference")
    assert engines[family].runner.backend == "xla"
    args = ("Answer Yes or No:", ["", " Paris", " the flag of Tokyo"], [3, 4, 3])
    for item_first, apply_softmax in ((False, False), (False, True), (True, False)):
        kw = dict(item_first=item_first, apply_softmax=apply_softmax)
        want = reference.score(*args, **kw).scores
        for path in planned:
            assert_scores_close(path.score(*args, **kw).scores, want)
    for made in (*planned[1:], reference):
        made.close()


@pytest.mark.parametrize("family, overrides, head_dim, projections", [
    ("qwen3", dict(head_dim=128), 128, True), ("qwen3", dict(head_dim=128), 128, False),
    ("llama", dict(num_key_value_heads=4), 32, True),
    ("qwen2", dict(num_key_value_heads=4), 32, True)])
def test_the_projection_norm_and_rope_kernels_score_as_the_reference(tmp_path, monkeypatch,
                                                                     family, overrides,
                                                                     head_dim, projections):
    """With heads the norm and RoPE kernel takes (Qwen3's norm on 128 lanes; Llama's and
    Qwen2's heads of 32, four to a lane group) and weights of whole lane tiles, every
    projection on its kernel (the weights read from the stacks at the layer; Qwen2's q, k and
    v biases), the layer's input norms in the kernels that read them, q's and k's norm and
    RoPE in the q and k projections, and k and v written into their pages by their
    projection (heads of 32 each into a lane tile of the pool's, as is q, and so the output
    projection takes the attention's); or, with
    too few tokens for the projection kernels, in the norm and RoPE kernel: the Pallas
    kernels in the TPU interpreter score as the dense reference."""
    from kernels import backends, projection_kernel
    from model import decoder
    from tests.tiny_models import write_checkpoint
    if projections:
        monkeypatch.setattr(projection_kernel, "MIN_TOKENS", 0)  # the tests' batches are small
        monkeypatch.setattr(projection_kernel, "NORM_MIN_STEPS", 1)
    traced, projected = [], []

    def counting(kernel, seen, key):
        def counted(*args, **kw):
            seen.append(key(kw))
            return kernel(*args, **kw)
        return counted

    monkeypatch.setattr(backends, "qk_norm_rope", counting(backends.qk_norm_rope, traced,
                                                           lambda kw: kw["head_dim"]))
    for name in ("project", "gated_up"):
        monkeypatch.setattr(backends, name, counting(
            getattr(backends, name), projected,
            lambda kw: (kw["name"], kw["rope"].head_dim if kw.get("rope") else None,
                        kw.get("pages") is not None, kw.get("x_norm") is not None,
                        kw.get("tile_heads", 0), kw.get("x_tile_heads", 0))))
    path = write_checkpoint(str(tmp_path / family), family, seed=5, hidden_size=128,
                            intermediate_size=256, **overrides)
    cfg = _scores_as_reference(path)
    want = {(name, head_dim if name in decoder.ROTATED_PROJECTIONS else None,
             name == "project_kv", name in ("project_q", "project_kv", "gate_up"),
             head_dim if head_dim % 128 and name in decoder.ROTATED_PROJECTIONS else 0,
             head_dim if head_dim % 128 and name == "project_out" else 0)
            for name in decoder.projection_shapes(cfg)}
    assert set(projected) == (want if projections else set())
    assert set(traced) == (set() if projections else {head_dim})


@pytest.mark.parametrize("family, overrides, tp, fused", [
    ("qwen3", dict(head_dim=128), 1, ("out_and_mlp", 0)),
    ("qwen3", dict(head_dim=128), 2, ("mlp", 0)),
    ("llama", dict(num_key_value_heads=4), 1, ("out_and_mlp", 32))])
def test_the_mlp_kernel_scores_as_the_reference(tmp_path, monkeypatch, family, overrides, tp,
                                                fused):
    """The layer after its attention in one kernel (the output projection and its residual
    add, the MLP's norm, gate and up, down and its residual add) on one device, taking
    Llama's heads of 32 in their lane tiles; split over two, the MLP alone (its row-split
    down's float32 partial sums all-reduced before the residual add, as the output
    projection's): the Pallas kernels in the TPU interpreter score as the dense reference,
    and the gate and up's kernel no longer runs."""
    from tests.tiny_models import write_checkpoint
    called = _counted_kernels(monkeypatch, ("gated_up", "mlp", "out_and_mlp"),
                              lambda name, kw: (name, kw.get("x_tile_heads", 0)))
    _scores_as_reference(write_checkpoint(str(tmp_path / family), family, seed=6,
                                          hidden_size=128, intermediate_size=512,
                                          **overrides), tp_size=tp)
    assert set(called) == {fused}


@pytest.mark.parametrize("mlp_fits", [True, False])
def test_the_int8_kernels_score_as_the_int8_reference(tmp_path, monkeypatch, mlp_fits):
    """An int8 Qwen3 (W8A8, rotated at load, Hadamard blocks before down) on the Pallas
    kernels in the TPU interpreter: q's and k/v's projections with x quantized per token in
    VMEM after the input norm they apply, the int32 products dequantized before q's and k's
    norm and RoPE and the pages; then the layer after attention in one kernel, or, where its
    weights do not fit VMEM, the projection kernels' output projection, gate and up (the
    SiLU, the Hadamard blocks) and down. It scores as the dense reference's int8 model
    (XLA's int8 dots), over most items: where the paths' float rounding differs (the norm in
    the kernel, attention's sums) a token near an int8 rounding tie rounds the other way,
    which moves a tiny random model's score by up to 0.1."""
    from kernels import mlp_kernel
    from tests.tiny_models import write_checkpoint
    called = _counted_kernels(
        monkeypatch, ("project", "gated_up", "mlp", "out_and_mlp"),
        lambda name, kw: (kw.get("name", name), len(kw.get("scales", ())),
                          kw.get("x_norm") is not None, kw.get("hadamard", 0)))
    if not mlp_fits:
        monkeypatch.setattr(mlp_kernel, "_WEIGHTS_BYTES", 0)
    path = write_checkpoint(str(tmp_path / "qwen3"), "qwen3", seed=7, hidden_size=128,
                            intermediate_size=256, head_dim=128)
    rng = np.random.default_rng(0)
    query, items = rng.integers(0, 300, 21).tolist(), [rng.integers(0, 300, n).tolist()
                                                       for n in (1, 3, 5, 8, 2, 13, 4, 6)]
    scores = []
    for kw in (dict(kernel_backend="interpret", q_block=8, kv_block=16, quantization="int8"),
               dict(kernel_backend="reference", quantization="int8"),
               dict(kernel_backend="reference")):
        engine = Engine.from_path(path, small_config(**kw))
        scores.append(np.log(engine.score(query, items, [3, 4, 5]).scores))
        engine.close()
    misses, gaps = (np.abs(scores[0] - other).max(axis=1) for other in scores[1:])
    assert np.median(misses) < 1e-4 and np.median(gaps) > 0.05, (misses, gaps)
    after_attention = ({("out_and_mlp", 4, True, 128)} if mlp_fits else
                       {("gate_up", 2, True, 128), ("project_out", 1, False, 0),
                        ("project_down", 1, False, 0)})
    assert set(called) == {("project_q", 1, True, 0), ("project_kv", 2, True, 0),
                           *after_attention}


def _counted_kernels(monkeypatch, names: tuple, key) -> list:
    """The projection and MLP kernels at every batch size (the tests' batches are small),
    each call of the backends' `names` recorded as key(name, its keywords)."""
    from kernels import backends, mlp_kernel, projection_kernel
    for module in (projection_kernel, mlp_kernel):
        monkeypatch.setattr(module, "MIN_TOKENS", 0)
        monkeypatch.setattr(module, "NORM_MIN_STEPS", 1)
    called = []

    def counting(name):
        kernel = getattr(backends, name)

        def counted(*args, **kw):
            called.append(key(name, kw))
            return kernel(*args, **kw)
        return counted
    for name in names:
        monkeypatch.setattr(backends, name, counting(name))
    return called


def _scores_as_reference(path: str, **kernel_config):
    """The Pallas kernels in the TPU interpreter (with `kernel_config`) score the checkpoint
    at `path` as the dense reference; returns its model config."""
    kernel, reference = (Engine.from_path(path, small_config(**kw)) for kw in (
        dict(kernel_backend="interpret", q_block=8, kv_block=16, **kernel_config),
        dict(kernel_backend="reference")))
    try:
        args = ("Answer Yes or No:", [" Paris", " the flag of Tokyo"], [3, 4, 3])
        assert_scores_close(kernel.score(*args).scores, reference.score(*args).scores)
        return kernel.runner.cfg
    finally:
        kernel.close()
        reference.close()


def test_the_xla_loop_takes_its_block_sizes_by_platform():
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    cpu = jax.devices("cpu")[0]
    items = dict(item_q_block=16, item_kv_block=32)  # CPU only: items off the q blocks
    assert EngineConfig().block_sizes(cpu) == BlockSizes(128, 128, **items)
    assert EngineConfig(q_block=64).block_sizes(cpu) == BlockSizes(64, 128, **items)
    assert EngineConfig().block_sizes(gpu) == BlockSizes(512, 1024)  # a GPU: few, large steps
    assert EngineConfig(q_block=32).block_sizes(gpu) == BlockSizes(32, 1024)
    with pytest.raises(ValueError, match="may not be negative"):
        EngineConfig(kv_block=-16)


def _forward_batch(engine, tokens: int):
    """bench_forward's batch of SGLang-shaped sequences for `tokens`, and its shape."""
    from profiling.bench_forward import schedule
    from runtime.batch_builder import build_batch
    runner = engine.runner
    entries, labels, shape = schedule(runner.buckets, engine.cfg.vocab_size, tokens,
                                      np.random.default_rng(0))
    return build_batch(entries, labels, shape, runner.buckets.page_size,
                       with_logsumexp=True), shape


@pytest.mark.parametrize("feature_major_max_tokens", [0, 512])
def test_per_layer_weights_give_the_stacked_forward(engines, monkeypatch,
                                                    feature_major_max_tokens):
    """CPU runners hold each layer's matrices apart and [out, in]
    (model.params.per_layer_matrices); the stacked [in, out] params that other devices scan
    give the same forward, with the 64 tokens' activations token-major or feature-major."""
    import functools

    from model import decoder
    from model.decoder import empty_cache, score_forward
    monkeypatch.setattr(decoder, "FEATURE_MAJOR_MAX_TOKENS", feature_major_max_tokens)
    engine = engines["qwen3"]
    runner, cfg = engine.runner, engine.cfg
    per_layer = runner.params
    assert "layer_matrices" in per_layer and "wq" not in per_layer["layers"]
    matrices = per_layer["layer_matrices"]
    stacked = {**{k: v for k, v in per_layer.items() if k != "layer_matrices"},
               "layers": {**per_layer["layers"],
                          **{k: jnp.stack([m[k].T for m in matrices]) for k in matrices[0]}}}
    batch, shape = _forward_batch(engine, 64)
    forward = jax.jit(functools.partial(score_forward, cfg=cfg, max_q_len=shape.tokens,
                                        backend="xla", sizes=runner.sizes))
    cache = empty_cache(cfg, runner.num_pages, runner.buckets.page_size, jnp.float32, "xla")
    got, want = forward(per_layer, cache, batch), forward(stacked, cache, batch)
    # `w @ x` and `x @ w` sum in different orders: up to 6e-6 apart on logits up to 3.9
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-5)  # label logits
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-5)  # logsumexp


def test_cpu_forwards_use_xlas_own_dots_and_score_as_with_the_defaults(engines):
    """On CPU the forward is compiled with runtime.forward_programs.COMPILER_OPTIONS: no
    YNNPACK fusions, which XLA's defaults make of the same program; the results agree."""

    from model.batch import pack
    from model.decoder import empty_cache
    runner = engines["qwen3"].runner
    batch, shape = _forward_batch(engines["qwen3"], 64)
    ours = runner.programs.get(shape)
    defaults = runner.programs.lower(shape).compile()
    assert "ynn_fusion" in defaults.as_text() and "ynn_fusion" not in ours.as_text()
    # each on a pool of its own: the batch's pages are not the engine's to write
    got, want = (program(runner.params, empty_cache(runner.cfg, runner.num_pages,
                                                    runner.buckets.page_size, jnp.float32,
                                                    "xla"), pack(batch))
                 for program in (ours, defaults))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)  # label logits
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)  # logsumexp


def test_the_mlps_silu_is_jaxs_to_float32_rounding_over_the_whole_range():
    """model.decoder writes silu with exp; at large negative inputs exp(-x) overflows to inf
    and the quotient must still be (minus) zero, never NaN."""

    from kernels.projection_kernel import silu
    x = jnp.concatenate([jnp.linspace(-120.0, 120.0, 100_001),
                         jnp.array([-3e38, -1e4, -88.7, -0.0, 0.0, 1e-30, 1e4, 3e38])])
    got, want = np.asarray(silu(x)), np.asarray(jax.nn.silu(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
