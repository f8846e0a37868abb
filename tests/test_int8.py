"""W8A8 int8 on the XLA path (kernels.int8, `--quantization int8`): the quantization rounds to
nearest and never divides by 0, the decoder's dots in each layout take it, the quantized model
scores as a NumPy W8A8 decoder does, and what cannot run int8 yet is refused at start-up."""
import numpy as np
import pytest

from kernels.int8 import dequantized, int8_matmul, quantize_tokens, quantize_weight
from model.config import config_from_hf
from model.loader import load_model
from model.params import param_dtypes, param_shapes
from runtime.engine import Engine
from tests.numpy_decoder import NumpyDecoder
from tests.tiny_models import VOCAB, hf_config, small_config

import jax.numpy as jnp


def test_weights_round_to_nearest_per_output_channel_and_a_zero_channel_gets_scale_1():
    # column 0: absmax 127 -> scale 1, 2.6 -> 3 (truncation gives 2), -2.6 -> -3; column 1 zero
    w = np.array([[2.6, 0.0], [-2.6, 0.0], [127.0, 0.0], [0.4, 0.0]], np.float32)
    values, scale = quantize_weight(w, axis=0)
    assert values.dtype == np.int8 and scale.dtype == np.float32
    np.testing.assert_array_equal(values[:, 0], [3, -3, 127, 0])
    np.testing.assert_array_equal(values[:, 1], 0)
    np.testing.assert_array_equal(scale, [1.0, 1.0])


def test_tokens_round_to_nearest_per_token_and_a_zero_token_gets_scale_1():
    x = jnp.array([[2.6, -2.6, 127.0, -0.4], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    values, scale = quantize_tokens(x, axis=1)
    np.testing.assert_array_equal(values, [[3, -3, 127, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(scale, [[1.0], [1.0]])
    fm_values, fm_scale = quantize_tokens(x.T, axis=0)  # feature-major: the same tokens
    np.testing.assert_array_equal(fm_values, np.asarray(values).T)
    np.testing.assert_array_equal(fm_scale, np.asarray(scale).T)
    assert np.all(np.isfinite(dequantized(jnp.zeros((2, 3), jnp.int32), scale,
                                          jnp.ones(3), False)))


def test_the_int8_product_is_the_integer_product_times_both_scales():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    values, scale = quantize_weight(w, axis=0)
    got = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(values), jnp.asarray(scale)))
    xs = np.abs(x).max(axis=1, keepdims=True) / 127
    xq = np.clip(np.rint(x / xs), -127, 127)
    want = (xq @ values.astype(np.float64)) * xs * scale
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.abs(got - x @ w).max() < 0.05 * np.abs(x @ w).max()  # near the float product


def test_an_int8_model_holds_int8_weights_with_float32_scales(model_dirs):
    cfg, params, _ = load_model(model_dirs["qwen2"], "bfloat16", "int8")
    layers = params["layers"]
    assert cfg.quantization == "int8"
    assert layers["wq"].dtype == np.int8 and layers["wq_scale"].dtype == np.float32
    assert layers["bq"].dtype == jnp.bfloat16 and params["embed"].dtype == jnp.bfloat16
    shapes, dtypes = param_shapes(cfg), param_dtypes(cfg, jnp.bfloat16)
    for key, array in layers.items():
        assert (array.shape, array.dtype) == (shapes["layers"][key], dtypes["layers"][key]), key


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_int8_model_scores_as_a_numpy_w8a8_decoder(model_dirs, family):
    """Items after a query, multi-item. The median over items: a token's quantization near a
    rounding tie can round the other way in float64 than in float32, which moves a tiny
    random model's score (one item in ~20 by 0.02-0.2 in log score); the float model's
    scores, which the test must tell apart, are 0.1-1.3 away."""
    engine = Engine.from_path(model_dirs[family], small_config(quantization="int8"))
    w8a8, float64 = NumpyDecoder(model_dirs[family], int8=True), NumpyDecoder(model_dirs[family])
    rng, labels = np.random.default_rng(1), [0, 5, VOCAB - 1]
    misses, gaps = [], []
    for n in (6, 12, 19, 30):
        query = rng.integers(0, VOCAB, n).tolist()
        items = [rng.integers(0, VOCAB, k).tolist() for k in (1, 4, 9)]
        got = np.log(engine.score(query, items, labels, apply_softmax=False).scores)
        for item, row in zip(items, got):
            misses.append(np.abs(row - np.log(w8a8.scores(query + item, labels, False))).max())
            gaps.append(np.abs(row - np.log(float64.scores(query + item, labels, False))).max())
    engine.close()
    assert np.median(misses) < 1e-4
    assert np.median(gaps) > 0.05


def test_what_cannot_run_int8_yet_is_refused_naming_the_fix(model_dirs):
    with pytest.raises(ValueError, match="tp-size"):
        Engine.from_path(model_dirs["qwen3"], small_config(quantization="int8", tp_size=2))
    with pytest.raises(ValueError, match="kernel-backend xla"):
        Engine.from_path(model_dirs["qwen3"], small_config(quantization="int8",
                                                           kernel_backend="interpret"))
    with pytest.raises(ValueError, match="quantization_config 'gptq'"):
        config_from_hf({**hf_config("qwen3"), "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="quantization must be one of"):
        small_config(quantization="int4")
