"""Gemma, Gemma 2 and Gemma 3 from GGUF files as llama.cpp's converter writes them
(tests/gguf_checkpoint.py): the model and its scores equal the HF checkpoint it was converted
from, the SentencePiece tokenizer equals transformers' reading of the same file, and what a
Gemma GGUF leaves unsaid is what llama.cpp assumes."""
import json
import os

import gguf
import jax
import numpy as np
import pytest

from model.config import NO_WINDOW
from model.gguf_file import read_gguf
from model.gguf_loader import gguf_config
from model.gguf_tokenizer import gguf_tokenizer
from model.loader import load_model
from runtime.engine import Engine
from tests.assertions import assert_scores_close
from tests.gguf_checkpoint import vocabulary, write_gguf
from tests.tiny_models import WINDOW, small_config, write_checkpoint

GGUF_VOCAB = 384  # the made-up vocabulary's tokens, bytes and pieces
CONVERTIBLE = {  # llama.cpp's rules where a GGUF is silent: Gemma 3's window on five of six
    #              layers, the attention scale head_dim ** -0.5 below 27B
    "gemma": {}, "gemma2": dict(query_pre_attn_scalar=32),
    "gemma3": dict(num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for i, (family, overrides) in enumerate(CONVERTIBLE.items()):
        hf_dir = write_checkpoint(str(root / family), family, seed=30 + i, vocab=GGUF_VOCAB,
                                  **overrides)
        out[family] = hf_dir, write_gguf(hf_dir, str(root / f"{family}.gguf"))
    return out


@pytest.mark.parametrize("family", CONVERTIBLE)
def test_a_gemma_gguf_loads_as_the_checkpoint_it_was_converted_from(converted, family):
    hf_cfg, hf_params, _ = load_model(converted[family][0])
    cfg, params, _ = load_model(converted[family][1])
    assert cfg.family == family and cfg.sm_scale == hf_cfg.sm_scale
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # stored as float32
    for field in ("vocab_size", "num_layers", "head_dim", "num_kv_heads", "norm_offset",
                  "embed_scale", "activation", "sandwich_norms", "qk_norm", "attn_softcap",
                  "final_softcap", "layer_windows", "rope_theta", "local_rope_theta",
                  "rope_factor", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    assert cfg.windowed == (family != "gemma")
    flat, hf_flat = _leaves(params), _leaves(hf_params)
    assert flat.keys() == hf_flat.keys()
    for name, array in flat.items():  # norms: the converter's 1 + w, less 1, plus 1 again
        np.testing.assert_allclose(array, hf_flat[name], rtol=0, atol=2e-7, err_msg=name)


def _leaves(params: dict) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def test_a_gemma3_gguf_scores_as_its_checkpoint(converted):
    rng = np.random.default_rng(3)
    query = rng.integers(0, GGUF_VOCAB, 2 * WINDOW + 1).tolist()
    items = [rng.integers(0, GGUF_VOCAB, n).tolist() for n in (1, 7, 3)]
    scores = []
    for path in converted["gemma3"]:
        engine = Engine.from_path(path, small_config())
        scores.append(np.array(engine.score(query, items, [0, 5, 300], True).scores))
        engine.close()
    assert_scores_close(scores[1], scores[0])


def test_a_gemma_gguf_tokenizes_as_transformers_reads_it(converted):
    """The vocabulary stores no merges: they are recovered in the file's order (the made-up
    scores would give other tokens for "and"); pieces of spaces respelled; control and
    user-defined tokens kept whole; bytes for what no piece covers; BOS first."""
    with open(os.path.join(os.path.dirname(__file__), "data", "hf_gguf_tokens.json")) as f:
        want = json.load(f)
    assert want["tokens"] == vocabulary(GGUF_VOCAB)[0]  # the fixture is the one stored
    tok = gguf_tokenizer(read_gguf(converted["gemma3"][1]))
    assert [tok.encode(text) for text in want["texts"]] == want["ids"]
    assert tok.start_ids == want["start_ids"] == [2]
    assert tok.decode(tok.encode("  the  theater\nand")) == "  the  theater\nand"


def metadata_only(path, arch: str, layers: int = 4, **keys) -> str:
    """A GGUF file with `arch`'s shape keys, `keys` ({name: value} under "{arch}."), a token
    embedding and a vocabulary: enough for gguf_config and gguf_tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_key_length(32)  # not hidden / heads
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        else:
            writer.add_key_value(f"{arch}.{key}", value, _value_type(value))
    writer.add_tokenizer_model("llama")
    tokens, scores, types = vocabulary(GGUF_VOCAB)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_tensor("token_embd.weight", np.zeros((GGUF_VOCAB, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _value_type(value):
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32


def read_config(path):
    return gguf_config(read_gguf(path))


def test_what_a_gemma_gguf_leaves_out_is_what_llama_cpp_assumes(tmp_path):
    gemma2 = read_config(metadata_only(tmp_path / "a.gguf", "gemma2"))
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.layer_windows == (4096, NO_WINDOW, 4096, NO_WINDOW)
    assert gemma2.sm_scale == 32 ** -0.5
    gemma2_27b = read_config(metadata_only(tmp_path / "b.gguf", "gemma2", layers=46))
    assert gemma2_27b.sm_scale == pytest.approx((64 / 4) ** -0.5) and gemma2_27b.query_scale
    gemma3 = read_config(metadata_only(tmp_path / "c.gguf", "gemma3", layers=7,
                                       **{"attention.sliding_window": 512,
                                          "rope.freq_base": 1e6}))
    assert gemma3.layer_windows == (512,) * 5 + (NO_WINDOW, 512)
    assert (gemma3.local_rope_theta, gemma3.rope_theta, gemma3.final_softcap) == (1e4, 1e6, 0)
    assert not read_config(metadata_only(tmp_path / "d.gguf", "gemma3")).windowed
    flagged = read_config(metadata_only(
        tmp_path / "e.gguf", "gemma3", **{"attention.sliding_window": 8,
                                          "attention.sliding_window_pattern":
                                          [True, False, False, True]}))
    assert flagged.layer_windows == (8, NO_WINDOW, NO_WINDOW, 8)


@pytest.mark.parametrize("arch, keys, message", [
    ("qwen3", {}, "general.architecture"),
    ("gemma3", {"rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn'"),
    ("gemma2", {"attention.sliding_window": 8,
                "attention.sliding_window_pattern": [True]}, "sliding_window_pattern"),
])
def test_a_gguf_we_cannot_serve_is_refused_naming_the_key(tmp_path, arch, keys, message):
    with pytest.raises(ValueError, match=message):
        read_config(metadata_only(tmp_path / "m.gguf", arch, **keys))


def test_a_sentencepiece_gguf_with_a_space_prefix_is_refused(tmp_path):
    path = metadata_only(tmp_path / "m.gguf", "llama")  # add_space_prefix unsaid: true
    with pytest.raises(ValueError, match="add_space_prefix"):
        gguf_tokenizer(read_gguf(path))
