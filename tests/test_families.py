"""Mistral and Gemma 1-3 (tiny random checkpoints, tests.tiny_models.WINDOWED_FAMILIES): a
multi-item request scores each item as HuggingFace transformers scores it alone (query, then
the item; stored by tests/hf_family_scores.py), with a sliding window shorter than the query,
soft-caps, Gemma's norms, GeGLU and per-layer RoPE; a window by packed position would fail;
and configs are read and refused field by field."""
import importlib
import json

import numpy as np
import pytest

from model.config import NO_WINDOW, config_from_hf
from runtime.engine import Engine
from tests.assertions import assert_scores_close
from tests.numpy_decoder import NumpyDecoder
from tests.tiny_models import VOCAB, WINDOW, WINDOWED_FAMILIES, hf_config, small_config, \
    write_checkpoint

attention = importlib.import_module("kernels.ragged_paged_attention")  # the module, not the
#                                   kernel that kernels/__init__ exports under its name
QUERY_LEN = 2 * WINDOW + 1  # items after it see only its last keys
ITEM_LENS = (1, 5, 0, 9, 3)
LABELS = [0, 7, VOCAB - 1]


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("windowed")
    return {f: write_checkpoint(str(root / f), f, seed=10 + i)
            for i, f in enumerate(WINDOWED_FAMILIES)}


def request(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, QUERY_LEN).tolist(),
            [rng.integers(0, VOCAB, n).tolist() for n in ITEM_LENS])


def each_alone(model_dir: str, query, items, apply_softmax: bool) -> np.ndarray:
    ref = NumpyDecoder(model_dir)
    return np.array([ref.scores(query + item, LABELS, apply_softmax) for item in items])


def test_a_window_by_packed_position_fails_the_comparison(windowed_dirs, monkeypatch):
    """The comparison above catches SGLang's error: with the window on the packed sequence's
    positions, the later items lose the query's keys and their scores move."""
    monkeypatch.setattr(attention, "logical_distance",
                        lambda kv_pos, q_pos, visible_from, shared_len: q_pos - kv_pos)
    engine = Engine.from_path(windowed_dirs["mistral"], small_config())
    query, items = request()
    try:
        got = np.array(engine.score(query, items, LABELS, apply_softmax=False).scores)
    finally:
        engine.close()
    want = each_alone(windowed_dirs["mistral"], query, items, False)
    misses = np.abs(np.log(got) - np.log(want)).max(axis=1)
    assert misses[0] < 1e-4 and misses[-1] > 1e-2  # the first item starts within the window


def test_gemma2_in_bfloat16_and_split_over_two_devices_scores_as_float32(windowed_dirs):
    query, items = request(1)
    scores = {}
    for name, overrides in (("f32", {}), ("bf16", dict(dtype="bfloat16")),
                            ("tp2", dict(tp_size=2))):
        engine = Engine.from_path(windowed_dirs["gemma2"], small_config(**overrides))
        scores[name] = np.array(engine.score(query, items, LABELS, apply_softmax=True).scores)
        engine.close()
    assert_scores_close(scores["tp2"], scores["f32"])
    np.testing.assert_allclose(scores["bf16"], scores["f32"], atol=0.05)


def gemma3_config(**fields) -> dict:
    return {**hf_config("gemma3"), **fields}


def test_gemma3_configs_of_both_forms_read_the_same():
    old = gemma3_config(num_hidden_layers=7, sliding_window_pattern=6)
    new = {k: v for k, v in old.items()
           if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                        "sliding_window_pattern")}
    new["layer_types"] = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    new["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
    a, b = config_from_hf(old), config_from_hf(new)
    assert a == b
    assert a.layer_windows == (WINDOW,) * 5 + (NO_WINDOW, WINDOW)
    assert (a.rope_theta, a.local_rope_theta, a.rope_factor) == (1e6, 1e4, 4.0)
    assert a.qk_norm and a.sandwich_norms and a.norm_offset == 1.0 and not a.attn_softcap
    assert a.sm_scale == 32 ** -0.5 and a.tie_word_embeddings


def test_a_mistral_with_linear_rope_scaling_scales_its_windowed_layers_too():
    """Only Gemma 3's windowed layers rotate by RoPE of their own."""
    cfg = config_from_hf(hf_config("mistral", rope_scaling={"rope_type": "linear",
                                                            "factor": 2.0}))
    assert cfg.windowed and cfg.rope_factor == 2.0 and not cfg.local_rope
    with pytest.raises(ValueError, match="rotate alike"):
        config_from_hf(hf_config("mistral", rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}))


def test_gemma2_windows_alternate_and_mistral_without_one_has_none():
    gemma2 = config_from_hf(hf_config("gemma2", num_hidden_layers=4))
    assert gemma2.layer_windows == (WINDOW, NO_WINDOW, WINDOW, NO_WINDOW)
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.sm_scale) == (2.0, 3.0, 24 ** -0.5)
    assert not config_from_hf(hf_config("mistral", sliding_window=None)).windowed


@pytest.mark.parametrize("fields, named", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn'"),
    (dict(hidden_activation="relu"), "hidden_act 'relu'"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
])
def test_configs_asking_for_what_is_not_implemented_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        config_from_hf(hf_config("gemma2", **fields))


def test_qwen2s_sliding_window_rule_is_refused():
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_hf(hf_config("qwen2", use_sliding_window=True, sliding_window=8))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_the_pallas_kernels_score_gemma_as_the_reference(windowed_dirs, family):
    """In the TPU interpreter: the attention kernel with the layer's window (by logical
    position, on the windowed layers' plan) and Gemma 2's soft-cap, the label gather with its
    final soft-cap, Gemma's float32 norms, GeGLU (XLA's ops), Gemma 3's local and global RoPE.
    (The projection kernels take float32 norms in tests/test_projection_kernel.py.)"""
    query, items = request(2)
    kernel, reference = (Engine.from_path(windowed_dirs[family], small_config(**kw)) for kw in (
        dict(kernel_backend="interpret", q_block=8, kv_block=16),
        dict(kernel_backend="reference")))
    try:
        for apply_softmax in (False, True):
            assert_scores_close(
                kernel.score(query, items, LABELS, apply_softmax=apply_softmax).scores,
                reference.score(query, items, LABELS, apply_softmax=apply_softmax).scores)
    finally:
        kernel.close()
        reference.close()


def test_scores_equal_transformers_own_item_by_item(tmp_path):
    """Against transformers' own implementation (eager attention, float32), each item scored
    alone, as stored by tests/hf_family_scores.py; the NumPy decoder agrees with it too."""
    from tests import hf_family_scores as hf
    with open(hf.OUT) as f:
        stored = json.load(f)
    query, items, labels = stored["query"], stored["items"], stored["labels"]
    assert (query, items) == hf.request()
    for family, want in stored["families"].items():
        model_dir = hf.checkpoint(str(tmp_path), family)
        assert hf.checksum(model_dir) == pytest.approx(want["checksum"], rel=1e-12)
        logits, lse = np.array(want["label_logits"]), np.array(want["logsumexp"])[:, None]
        ref = NumpyDecoder(model_dir)
        numpy_logits = np.array([ref.last_logits(query + item)[labels] for item in items])
        np.testing.assert_allclose(numpy_logits, logits, atol=2e-5)
        engine = Engine.from_path(model_dir, small_config())
        try:
            got = engine.score(query, items, labels, apply_softmax=False).scores
            softmax = engine.score(query, items, labels, apply_softmax=True).scores
        finally:
            engine.close()
        assert_scores_close(got, np.exp(logits - lse))
        label_lse = np.log(np.exp(logits).sum(axis=1, keepdims=True))
        assert_scores_close(softmax, np.exp(logits - label_lse))
        windows = engine.cfg.layer_windows
        assert family == "gemma" or (hf.WINDOW in windows and len(query) > hf.WINDOW)
