"""W8A8 int8 on the XLA path (kernels.int8, `--quantization int8`): the quantization rounds to
nearest and never divides by 0, the decoder's dots in each layout take it, the residual
stream's rotation and down's Hadamard blocks (model.rotation) and smoothing (model.smoothing)
keep the float model and take activation outliers out of the way, the quantized model scores
as a NumPy W8A8 decoder does, and what cannot run int8 yet is refused at start-up."""
import dataclasses
import functools
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kernels.int8 import (
    dequantized,
    hadamard,
    hadamard_blocks,
    int8_matmul,
    quantize_tokens,
    quantize_weight,
)
from model.config import config_from_hf, int8_config, rotatable
from model.loader import load_model
from model.params import param_dtypes, param_shapes, quantized
from model.rotation import down_hadamard_folded, rotated, rotation_matrix
from model.smoothing import (
    activation_absmax,
    calibration_tokens,
    smoothed,
    smoothing_factors,
)
from runtime.engine import Engine
from tests.numpy_decoder import NumpyDecoder
from tests.tiny_models import VOCAB, hf_config, small_config, write_checkpoint

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


def test_bfloat16_tokens_quantize_as_the_same_numbers_in_float32():
    """The maximum is taken in x's dtype, the product in float32: the same int8 values."""
    x = jnp.array([[-127.0, 2.5, 3.5, -63.5], [0.5, -1.0, 0.25, 0.0]], jnp.bfloat16)
    values, scale = quantize_tokens(x, axis=1)
    np.testing.assert_array_equal(values, [[-127, 2, 4, -64], [64, -127, 32, 0]])  # ties to even
    f32_values, f32_scale = quantize_tokens(x.astype(jnp.float32), axis=1)
    np.testing.assert_array_equal(values, f32_values)
    np.testing.assert_array_equal(scale, f32_scale)


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


def test_hadamard_blocks_multiply_each_block_of_features_by_sylvesters_matrix():
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], np.float32)
    np.testing.assert_array_equal(hadamard(4), h4)
    x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    want = np.concatenate([x[:, :4] @ h4, x[:, 4:] @ h4], axis=1)
    np.testing.assert_allclose(hadamard_blocks(jnp.asarray(x), 4, axis=1), want, rtol=1e-6)
    np.testing.assert_allclose(hadamard_blocks(jnp.asarray(x.T), 4, axis=0), want.T, rtol=1e-6)
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block 16"):
        hadamard_blocks(jnp.asarray(x), 16, axis=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "gemma2"])
def test_an_int8_models_rotation_and_hadamard_blocks_keep_the_float_model(model_dirs, tmp_path,
                                                                          family):
    """The residual stream rotated (not Gemma 2's: its sandwich norms do not commute with a
    rotation), down's input in Hadamard blocks, their inverses folded into the weights: every
    score as the float model's (Qwen2's biases, Qwen3's q and k norms, Gemma's 1 + w norms and
    scaled embeddings, its tied head)."""
    path = model_dirs.get(family) or write_checkpoint(str(tmp_path / family), family)
    cfg, params, tokenizer = load_model(path, "float32")
    int8_cfg = int8_config(cfg)
    assert rotatable(cfg) == (family != "gemma2") and int8_cfg.down_hadamard == 32
    assert not int8_cfg.tie_word_embeddings or family == "gemma2"
    folded_cfg = dataclasses.replace(int8_cfg, quantization="")
    want = _scores(Engine.local(cfg, params, tokenizer, small_config()), QUERY, ITEMS)
    if rotatable(cfg):
        params = rotated(cfg, params)
        assert np.abs(params["layers"]["attn_norm"] - 1).max() == 0
    folded = down_hadamard_folded(params, folded_cfg.down_hadamard)
    got = _scores(Engine.local(folded_cfg, folded, tokenizer, small_config()), QUERY, ITEMS)
    np.testing.assert_allclose(got, want, atol=2e-5)
    unfolded = _scores(Engine.local(folded_cfg, params, tokenizer, small_config()), QUERY, ITEMS)
    assert np.abs(unfolded - want).max() > 1e-3  # the blocks do move down's input


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_the_int8_model_scores_as_a_numpy_w8a8_decoder(model_dirs, tmp_path, family):
    """Loaded with --quantization int8: rotated, or smoothed (Gemma 2: the NumPy decoder folds
    the same factors, down's left to its Hadamard blocks), down's input in Hadamard blocks.
    Items after a query, multi-item. The median over items: a token's quantization near a
    rounding tie can round the other way in float64 than in float32, which moves a tiny random
    model's score (one item in ~20 by 0.02-0.2 in log score); the float model's, which the
    test must tell apart, are a median 0.03 (Gemma 2) to 0.44 away."""
    path = model_dirs.get(family) or write_checkpoint(str(tmp_path / family), family)
    cfg, params, tokenizer = load_model(path, "float32")
    int8_cfg = int8_config(cfg)
    smoothing = None
    if not rotatable(cfg):
        factors = _factors(cfg, params, tokenizer)
        smoothing = {**factors, "down": np.ones_like(factors["down"])}
    engine = Engine.from_path(path, small_config(quantization="int8"))
    assert engine.cfg == int8_cfg
    w8a8 = NumpyDecoder(path, int8=True, smoothing=smoothing, hadamard=int8_cfg.down_hadamard,
                        rotation=rotation_matrix(cfg.hidden_size) if rotatable(cfg) else None)
    float64 = NumpyDecoder(path)
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
    assert np.median(gaps) > 0.01, gaps


def _factors(cfg, params: dict, tokenizer) -> dict:
    absmax = activation_absmax(cfg, params, calibration_tokens(tokenizer))
    return smoothing_factors(cfg, params, absmax)


def _scores(engine: Engine, query, items) -> np.ndarray:
    scores = engine.score(query, items, [0, 5, VOCAB - 1], apply_softmax=False).scores
    engine.close()
    return np.log(scores)


QUERY, ITEMS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [[5, 3], [5], [8, 9, 7], [9, 3, 2, 3, 8]]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2"])
def test_smoothing_keeps_the_float_model(model_dirs, tmp_path, family):
    """Its factors folded into the norms, v's columns and up's (GQA: two query heads a KV
    head; Qwen2's v bias, Qwen3's q and k norms, Gemma 2's 1 + w norms) leave every score."""
    path = model_dirs.get(family) or write_checkpoint(str(tmp_path / family), family)
    cfg, params, tokenizer = load_model(path, "float32")
    factors = _factors(cfg, params, tokenizer)
    assert all(np.ptp(f) > 0.1 for f in factors.values())  # channels are moved, and unevenly
    smooth = Engine.local(cfg, smoothed(cfg, params, factors), tokenizer, small_config())
    want = _scores(Engine.local(cfg, params, tokenizer, small_config()), QUERY, ITEMS)
    np.testing.assert_allclose(_scores(smooth, QUERY, ITEMS), want, atol=2e-5)


@pytest.mark.parametrize("outliers_out", ["rotated", "smoothed"])
def test_an_outlier_channel_is_taken_out_of_int8s_way(model_dirs, tmp_path, outliers_out):
    """A checkpoint whose norms put one channel's activations 100 times the others' (the
    projections' rows divided back: the float model is unchanged): rounded to nearest alone,
    int8 loses the other channels; loaded with --quantization int8 (the residual stream
    rotated), or smoothed, it scores near the float model again."""
    path = shutil.copytree(model_dirs["llama"], str(tmp_path / "outlier"))
    file = next(os.path.join(path, p) for p in os.listdir(path) if p.endswith(".safetensors"))
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("input_layernorm.weight",
                                                   "post_attention_layernorm.weight"))]:
        tensors[name][7] *= 100
        reads = ("q", "k", "v") if "input" in name else ("gate", "up")
        prefix = name.rsplit(".", 2)[0] + (".self_attn." if "input" in name else ".mlp.")
        for proj in reads:
            tensors[f"{prefix}{proj}_proj.weight"][:, 7] /= 100
    save_file(tensors, file)
    cfg, params, tokenizer = load_model(path, "float32")
    want = _scores(Engine.from_path(model_dirs["llama"], small_config()), QUERY, ITEMS)
    np.testing.assert_allclose(_scores(Engine.local(cfg, params, tokenizer, small_config()), QUERY,
                                       ITEMS), want, atol=1e-4)
    int8_cfg = dataclasses.replace(cfg, quantization="int8")
    rounded = Engine.local(int8_cfg, quantized(params), tokenizer, small_config())
    if outliers_out == "rotated":
        taken = Engine.from_path(path, small_config(quantization="int8"))
    else:
        smooth = smoothed(cfg, params, _factors(cfg, params, tokenizer))
        taken = Engine.local(int8_cfg, quantized(smooth), tokenizer, small_config())
    rounded_miss = np.abs(_scores(rounded, QUERY, ITEMS) - want).max()
    taken_miss = np.abs(_scores(taken, QUERY, ITEMS) - want).max()
    assert taken_miss < rounded_miss / 4


def test_the_tpu_backends_xla_dots_below_the_projection_kernel_take_int8(model_dirs):
    """A tiny Qwen3's weights are not whole lane tiles, so the TPU backend's layers run
    XLA's dots on its stacks, k's and v's as one group [in, 2, out] (model.params.grouped_kv):
    int8, they score as the CPU layout's int8 model."""
    scores = []
    for backend in ("interpret", "reference"):
        engine = Engine.from_path(model_dirs["qwen3"], small_config(
            quantization="int8", kernel_backend=backend, q_block=8, kv_block=16))
        assert ("w_kv" in engine.runner.params["layers"]) == (backend == "interpret")
        scores.append(_scores(engine, QUERY, ITEMS))
    np.testing.assert_allclose(scores[0], scores[1], atol=1e-4)


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
    """Its int8 values and scales, read as they are (no flag, no smoothing), equal the ones
    rounding the float checkpoint to nearest gives (as it was written); so do the scores."""
    w8a8 = compressed_tensors_copy(model_dirs[family], str(tmp_path / family))
    cfg, params, tokenizer = load_model(w8a8, quantization="int8")
    float_cfg, float_params, _ = load_model(model_dirs[family], "float32")
    want = quantized(float_params)
    assert cfg == dataclasses.replace(float_cfg, quantization="int8")
    for key in ("wq", "wq_scale", "w_down", "w_down_scale", "attn_norm"):
        np.testing.assert_array_equal(params["layers"][key], want["layers"][key])
    np.testing.assert_array_equal(
        _scores(Engine.from_path(w8a8, small_config()), QUERY, ITEMS),
        _scores(Engine.local(cfg, want, tokenizer, small_config()), QUERY, ITEMS))


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
    """TP > 1; TPUs whose Pallas dots do not take int8 (v4; TPU7x, fp8's); other schemes."""
    import types
    from kernels.int8 import int8_runs_on
    with pytest.raises(ValueError, match="tp-size"):
        Engine.from_path(model_dirs["qwen3"], small_config(quantization="int8", tp_size=2))
    tpu = functools.partial(types.SimpleNamespace, platform="tpu")
    assert [int8_runs_on(tpu(device_kind=kind)) for kind in (
        "TPU v4", "TPU7x", "TPU v5 lite", "TPU v5", "TPU v6 lite")] == [
        False, False, True, True, True]
    assert int8_runs_on(types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100"))
    with pytest.raises(ValueError, match="quantization_config 'gptq'"):
        config_from_hf({**hf_config("qwen3"), "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="quantization must be one of"):
        small_config(quantization="int4")


def test_the_ranking_studys_measures():
    """profiling.int8_ranking: a fixed scoring set (as rerank requests too), Spearman's
    correlation, top-1 agreement."""
    from profiling.int8_ranking import compare, rerank_case, scoring_set, spearman
    cases = scoring_set(3, 20, seed=0)
    assert cases == scoring_set(3, 20, seed=0) and len(cases[1][1]) == 20
    assert len(set(cases[0][1])) == 20 and cases[0][0].startswith("Query: ")
    assert rerank_case("Query: I am looking for a toy for a rainy day.\nItem:",
                       [" a cheap kite\nIs this a good match? Answer yes or no:"]) == (
        "a toy for a rainy day", ["a cheap kite"])
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    base = np.array([[0.1, 0.5, 0.3], [0.2, 0.1, 0.9]])
    swapped = np.array([[0.1, 0.3, 0.5], [0.2, 0.1, 0.9]])
    result = compare(base, swapped)
    assert result["top1_agreement"] == 0.5 and result["min_spearman"] == pytest.approx(0.5)
    assert result["max_probability_difference"] == pytest.approx(0.2)
    assert not result["targets_met"] and compare(base, base)["targets_met"]
