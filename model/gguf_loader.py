"""Loads a llama-architecture GGUF file (the embedded SmolLM2-135M-Instruct).

Tensors are dequantized with `gguf`, renamed to HF names, and the Q/K rows that llama.cpp's
converter permuted (for its interleaved RoPE) are put back in HF order.
"""
import os

import numpy as np
import tokenizers
from gguf import GGUFReader, dequantize
from tokenizers import decoders, models, pre_tokenizers

from model.config import ModelConfig
from model.params import build_params
from model.tokenizer import TextTokenizer

_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_CONTROL_TOKEN = 3


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    get = lambda key, default=None: _field(reader, f"llama.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        family="llama",
        vocab_size=int(get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
    )


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    if kind not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of q/k projection rows (out features)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _dequantized(tensor, cfg: ModelConfig) -> np.ndarray:
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(reversed([int(n) for n in tensor.shape])))
    if tensor.name.endswith("attn_q.weight"):
        return unpermute_rows(w, cfg.num_heads)
    if tensor.name.endswith("attn_k.weight"):
        return unpermute_rows(w, cfg.num_kv_heads)
    return w


def gguf_tokenizer(reader: GGUFReader) -> TextTokenizer:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=False)
    tok = tokenizers.Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: digits split one by one, then GPT-2's byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type")
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL_TOKEN])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    return TextTokenizer(tok, start_ids=[int(bos)] if add_bos and bos is not None else [])


def load_gguf_model(path: str, dtype) -> tuple[ModelConfig, dict, TextTokenizer]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file {path}")
    reader = GGUFReader(path)
    cfg = gguf_config(reader)
    by_name = {hf_name(t.name): t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in by_name:
            raise KeyError(f"GGUF file has no tensor for {name!r}")
        return _dequantized(by_name[name], cfg)

    return cfg, build_params(cfg, get, dtype), gguf_tokenizer(reader)
