"""Engine scores vs an independent float64 NumPy decoder, for every supported family."""
import numpy as np
import pytest
import tokenizers

from tests.assertions import assert_scores_close
from tests.tiny_models import VOCAB

QUERY = "I pledge allegiance"
ITEMS = ["", " to", " the flag of Tokyo", "é"]
LABELS = [5, 17, 255, 17]  # a duplicated label gets the same value twice
CAUSAL = ["llama", "qwen2", "qwen3"]


def hf_prompt(model_dir: str, first: str, second: str) -> list[int]:
    """Prompt built straight with `tokenizers`: specials only at the start of the prompt."""
    tok = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    return (tok.encode(first, add_special_tokens=True).ids
            + tok.encode(second, add_special_tokens=False).ids)


def expected_scores(model_dirs, numpy_models, family, item_first, apply_softmax, labels):
    ref = numpy_models[family]
    out = []
    for item in ITEMS:
        first, second = (item, QUERY) if item_first else (QUERY, item)
        out.append(ref.scores(hf_prompt(model_dirs[family], first, second), labels, apply_softmax))
    return np.array(out)


@pytest.mark.parametrize("family", CAUSAL + ["qwen3_cls"])
@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_scores_match_numpy(engines, numpy_models, model_dirs, family, apply_softmax,
                                 item_first):
    got = engines[family].score(QUERY, ITEMS, LABELS, apply_softmax, item_first)
    want = expected_scores(model_dirs, numpy_models, family, item_first, apply_softmax, LABELS)
    assert_scores_close(got.scores, want)


@pytest.mark.parametrize("family", CAUSAL)
def test_token_id_inputs_match_numpy(engines, numpy_models, family):
    rng = np.random.default_rng(7)
    query = rng.integers(0, VOCAB, 11).tolist()
    items = [rng.integers(0, VOCAB, n).tolist() for n in (1, 5, 0, 9)]
    got = engines[family].score(query, items, [0, 319], apply_softmax=False)
    want = [numpy_models[family].scores(query + it, [0, 319], False) for it in items]
    assert_scores_close(got.scores, want)
    assert got.prompt_tokens == len(query) + sum(map(len, items))


def test_bos_only_at_prompt_start(engines, model_dirs):
    llama = engines["llama"]
    bos = tokenizers.Tokenizer.from_file(f"{model_dirs['llama']}/tokenizer.json").token_to_id("<s>")
    assert llama.tokenizer.start_ids == [bos]
    assert engines["qwen3"].tokenizer.start_ids == []
    assert bos not in llama.tokenizer.encode("a query")


def test_classifier_ignores_labels_and_returns_classes(engines):
    got = engines["qwen3_cls"].score(QUERY, ["a", "b"], label_token_ids=None)
    assert np.array(got.scores).shape == (2, 3)
    soft = engines["qwen3_cls"].score(QUERY, ["a", "b"], [1], apply_softmax=True)
    np.testing.assert_allclose(np.sum(soft.scores, axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_cls"])
def test_bfloat16_engine_is_close_to_float32(model_dirs, engines, family):
    from runtime.engine import Engine
    from tests.tiny_models import small_config
    bf16 = Engine.from_path(model_dirs[family], small_config(dtype="bfloat16"))
    got = np.array(bf16.score(QUERY, ITEMS, LABELS, apply_softmax=True).scores)
    want = np.array(engines[family].score(QUERY, ITEMS, LABELS, apply_softmax=True).scores)
    assert bf16.runner.cache.k.dtype == np.dtype("bfloat16")
    bf16.close()
    np.testing.assert_allclose(got, want, atol=0.05)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-6)
