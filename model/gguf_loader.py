"""Loads a GGUF file of the architectures llama.cpp names llama, gemma, gemma2 and gemma3 (the
embedded SmolLM2-135M-Instruct is a llama).

Tensors are dequantized with `gguf` and renamed to HF names. What llama.cpp's converter changed
is undone: the Q/K rows it permuted for its interleaved RoPE (llama) and the 1 it added to every
Gemma norm. What a Gemma GGUF leaves out of its metadata is what llama.cpp assumes: Gemma 2's
window (4096) on even layers and soft-caps 50 and 30, Gemma 3's window on five layers of six
with RoPE base 10,000 there, and the attention scale of the released sizes (head_dim ** -0.5,
but (hidden / heads) ** -0.5 at 27B).
"""
import os

import numpy as np
from gguf import dequantize

from model.config import NO_WINDOW, ModelConfig
from model.gguf_file import GGUFFile, GGUFTensor, read_gguf
from model.gguf_tokenizer import gguf_tokenizer
from model.params import build_params
from model.tokenizer import TextTokenizer

_GEMMAS = ("gemma", "gemma2", "gemma3")
_ARCHITECTURES = ("llama", *_GEMMAS)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm"}
_SANDWICH_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}  # gemma2, gemma3
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # layer i windowed iff i % n < n - 1
_SOFTCAPS = {"gemma2": (50.0, 30.0)}  # (attention, final) where the file does not say
_DEFAULT_WINDOW = {"gemma2": 4096}
_LARGEST = {"gemma2": 46, "gemma3": 62}  # the 27B's layers: its query scale is hidden / heads
_LOCAL_ROPE_THETA = 10000.0


def gguf_config(gguf_file: GGUFFile) -> ModelConfig:
    arch = gguf_file.fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(general.architecture: {', '.join(_ARCHITECTURES)})")
    get = lambda key, default=None: gguf_file.fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    layers = int(get("block_count"))
    tensors = {t.name: t for t in gguf_file.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight")
    family = {}
    if arch in _GEMMAS:
        family = _gemma_fields(arch, get, layers, hidden // heads)
    return ModelConfig(
        family=arch,
        vocab_size=tensors["token_embd.weight"].shape[-1],
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length") or get("rope.dimension_count")
                     or hidden // heads),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        rope_factor=_rope_factor(get),
        **family,
    )


def _gemma_fields(arch: str, get, layers: int, hidden_per_head: int) -> dict:
    attn_cap, final_cap = _SOFTCAPS.get(arch, (0.0, 0.0))
    window = (int(get("attention.sliding_window", _DEFAULT_WINDOW.get(arch, 0)))
              if arch in _SWA_PATTERN else 0)
    return dict(
        norm_offset=1.0, embed_scale=True, activation="gelu_tanh",
        sandwich_norms=arch != "gemma",
        attn_softcap=float(get("attn_logit_softcapping", attn_cap)) if arch == "gemma2" else 0.0,
        final_softcap=float(get("final_logit_softcapping", final_cap)),
        query_scale=float(hidden_per_head) if layers == _LARGEST.get(arch) else 0.0,
        layer_windows=_windows(get, arch, layers, window) if window else (),
        local_rope_theta=(float(get("rope.freq_base_swa", _LOCAL_ROPE_THETA))
                          if arch == "gemma3" and window else 0.0),
    )


def _windows(get, arch: str, layers: int, window: int) -> tuple[int, ...]:
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # a flag a layer
        if len(pattern) != layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"flags for {layers} layers")
        windowed = [bool(p) for p in pattern]
    else:
        n = int(pattern or _SWA_PATTERN[arch])
        windowed = [i % n < n - 1 for i in range(layers)]
    return tuple(window if w else NO_WINDOW for w in windowed)


def _rope_factor(get) -> float:
    kind = get("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported (none, linear)")
    return float(get("rope.scaling.factor", 1.0)) if kind == "linear" else 1.0


def hf_name(gguf_name: str, cfg: ModelConfig) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    names = _SANDWICH_NAMES if cfg.sandwich_norms else _LAYER_NAMES
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    _, layer, kind, suffix = parts
    return f"model.layers.{layer}.{names[kind]}.{suffix}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of q/k projection rows (out features)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _dequantized(tensor: GGUFTensor, cfg: ModelConfig) -> np.ndarray:
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(reversed(tensor.shape)))
    if cfg.norm_offset and tensor.name.endswith("norm.weight"):
        return w - np.float32(cfg.norm_offset)  # build_params adds it back, in float32
    if cfg.family != "llama":
        return w
    if tensor.name.endswith("attn_q.weight"):
        return unpermute_rows(w, cfg.num_heads)
    if tensor.name.endswith("attn_k.weight"):
        return unpermute_rows(w, cfg.num_kv_heads)
    return w


def load_gguf_model(path: str, dtype) -> tuple[ModelConfig, dict, TextTokenizer]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file {path}")
    gguf_file = read_gguf(path)
    if gguf_file.byte_order != "<":  # gguf's dequantize reads blocks and values little-endian
        raise ValueError(f"{path} is a big-endian GGUF file; only little-endian ones load")
    cfg = gguf_config(gguf_file)
    by_name = {hf_name(t.name, cfg): t for t in gguf_file.tensors}

    def get(name: str) -> np.ndarray:
        if name not in by_name:
            raise KeyError(f"GGUF file has no tensor for {name!r}")
        return _dequantized(by_name[name], cfg)

    return cfg, build_params(cfg, get, dtype), gguf_tokenizer(gguf_file)
