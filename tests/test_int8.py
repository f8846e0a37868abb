"""W8A8 int8 on the XLA path (kernels.int8, `--quantization int8`): the quantization rounds to
nearest and never divides by 0, the decoder's dots in each layout take it, the quantized model
scores as a NumPy W8A8 decoder does, and what cannot run int8 yet is refused at start-up."""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

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


W8A8_CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized",
               "quantization_status": "compressed", "ignore": ["lm_head"],
               "config_groups": {"group_0": {
                   "targets": ["Linear"],
                   "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                               "strategy": "channel", "dynamic": False, "group_size": None},
                   "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                         "strategy": "token", "dynamic": True,
                                         "group_size": None}}}}


def compressed_tensors_copy(src: str, dst: str) -> str:
    """`src` written as llm-compressor writes a W8A8 checkpoint: each layer's Linear weight
    int8 [out, in] rounded to nearest per output channel, its scales `weight_scale` [out, 1]
    (float32), the quantization_config in config.json."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": W8A8_CONFIG}, f)
    for path in [p for p in os.listdir(dst) if p.endswith(".safetensors")]:
        tensors = load_file(os.path.join(dst, path))
        for name in [n for n in tensors if n.startswith("model.layers.")
                     and n.endswith("_proj.weight")]:
            w = tensors[name].astype(np.float64)
            scale = np.abs(w).max(axis=1, keepdims=True) / 127
            tensors[name] = np.rint(w / scale).astype(np.int8)
            tensors[name + "_scale"] = scale.astype(np.float32)
        save_file(tensors, os.path.join(dst, path))
    return dst


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_compressed_tensors_w8a8_checkpoint_serves_its_own_int8_weights(model_dirs, tmp_path,
                                                                          family):
    """Its int8 values and scales, read as they are (no flag), equal the ones quantizing the
    float checkpoint at load gives; so do the scores."""
    w8a8 = compressed_tensors_copy(model_dirs[family], str(tmp_path / family))
    cfg, params, _ = load_model(w8a8)
    want_cfg, want, _ = load_model(model_dirs[family], "float32", "int8")
    assert cfg == want_cfg and cfg.quantization == "int8"
    for key in ("wq", "wq_scale", "w_down", "w_down_scale"):
        np.testing.assert_array_equal(params["layers"][key], want["layers"][key])
    query, items = [3, 1, 4, 1, 5, 9, 2, 6], [[5, 3], [5], [8, 9, 7]]
    scores = []
    for path in (w8a8, model_dirs[family]):
        engine = Engine.from_path(path, small_config(quantization="" if path == w8a8
                                                     else "int8"))
        scores.append(engine.score(query, items, [0, 5], apply_softmax=True).scores)
        engine.close()
    np.testing.assert_array_equal(scores[0], scores[1])


@pytest.mark.parametrize("change, named", [
    (dict(format="float-quantized"), "format"),
    (dict(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore"),
    (dict(config_groups={"group_0": {**W8A8_CONFIG["config_groups"]["group_0"],
                                     "input_activations": None}}), "input_activations"),
])
def test_another_compressed_tensors_scheme_is_refused_naming_what_differs(change, named):
    with pytest.raises(ValueError, match=f"its {named} differ"):
        config_from_hf({**hf_config("qwen3"), "quantization_config": {**W8A8_CONFIG,
                                                                        **change}})


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


def test_the_ranking_studys_measures():
    """profiling.int8_ranking: a fixed scoring set, Spearman's correlation, top-1 agreement."""
    from profiling.int8_ranking import compare, scoring_set, spearman
    cases = scoring_set(3, 20, seed=0)
    assert cases == scoring_set(3, 20, seed=0) and len(cases[1][1]) == 20
    assert len(set(cases[0][1])) == 20 and cases[0][0].startswith("Query: ")
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    base = np.array([[0.1, 0.5, 0.3], [0.2, 0.1, 0.9]])
    swapped = np.array([[0.1, 0.3, 0.5], [0.2, 0.1, 0.9]])
    result = compare(base, swapped)
    assert result["top1_agreement"] == 0.5 and result["min_spearman"] == pytest.approx(0.5)
    assert result["max_probability_difference"] == pytest.approx(0.2)
    assert not result["targets_met"] and compare(base, base)["targets_met"]
