"""Params pytree built from tensors named as in HuggingFace checkpoints.

Layer weights are stacked along a leading layer axis (the decoder scans over it) and
stored as [in, out] so that the forward pass is `x @ w`; on CPU the matrices are then split
into one array per layer, [out, in] (`per_layer_matrices`), and for the TPU kernels k's and
v's are one stack (`grouped_kv`). The output head stays [rows, H]:
the label gather reads rows of it. Arrays stay on the host (numpy, in the target dtype) until
the model runner places them on its devices, split or whole.
"""
from typing import Callable

import numpy as np

from kernels.int8 import SCALE_SUFFIX, quantize_weight
from model.config import ModelConfig

GetTensor = Callable[[str], np.ndarray]

_LINEARS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                   "mlp_norm": "pre_feedforward_layernorm",
                   "mlp_out_norm": "post_feedforward_layernorm"}  # Gemma 2 and 3
NORM_VECTORS = ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm")
KV_GROUP = "w_kv"  # `grouped_kv`: [layers, 2, in, out], k's weights then v's


def layer_norms(cfg: ModelConfig) -> dict[str, str]:
    """The layer's norms: params name -> HF module name."""
    return _SANDWICH_NORMS if cfg.sandwich_norms else _NORMS


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF layout [out, in] of every per-layer tensor, keyed by params name."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q), "w_gate": (i, h),
              "w_up": (i, h), "w_down": (h, i), **{n: (h,) for n in layer_norms(cfg)}}
    if cfg.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        shapes["bo"] = (h,)
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    return shapes


def hf_layer_name(key: str, layer: int, cfg: ModelConfig) -> str:
    prefix = f"model.layers.{layer}."
    if key in _LINEARS:
        return prefix + _LINEARS[key] + ".weight"
    norms = layer_norms(cfg)
    if key in norms:
        return prefix + norms[key] + ".weight"
    if key in ("q_norm", "k_norm"):
        return prefix + f"self_attn.{key}.weight"
    return prefix + _LINEARS["w" + key[1]] + ".bias"  # bq, bk, bv, bo


def _checked(get: GetTensor, name: str, shape: tuple[int, ...]) -> np.ndarray:
    arr = get(name)
    if tuple(arr.shape) != shape:
        raise ValueError(f"tensor {name} has shape {tuple(arr.shape)}, expected {shape}")
    return arr


def _stacked(get: GetTensor, cfg: ModelConfig, key: str, shape, dtype) -> dict:
    """The layers' tensors of `key` stacked (a linear's [in, out]) in `dtype`; a linear of a
    W8A8 checkpoint as its int8 values and per-channel scales (kernels.int8)."""
    names = [hf_layer_name(key, i, cfg) for i in range(cfg.num_layers)]
    if key in _LINEARS and cfg.quantization:
        return _int8_stacks(key, [_int8_weight(get, name, shape) for name in names])
    stacked = np.stack([_checked(get, name, shape) for name in names]).astype(np.float32)
    if key in _LINEARS:
        stacked = stacked.transpose(0, 2, 1)
    if key in NORM_VECTORS:
        return {key: _norm_weight(cfg, stacked, dtype)}
    return {key: stacked.astype(dtype)}


def _int8_weight(get: GetTensor, name: str, shape) -> tuple[np.ndarray, np.ndarray]:
    """A W8A8 checkpoint's linear: its int8 values [in, out] and per-channel scales [out]
    (stored [out, 1] as `name` + SCALE_SUFFIX)."""
    w = _checked(get, name, shape)
    if w.dtype != np.int8:
        raise ValueError(f"tensor {name} is {w.dtype}: the config declares int8 W8A8 weights")
    scale = _checked(get, name + SCALE_SUFFIX, (shape[0], 1))
    return w.T, scale.reshape(-1).astype(np.float32)


def quantized(params: dict) -> dict:
    """`params` with each layer's linears [layers, in, out] as int8 values and per-output-
    channel float32 scales (kernels.int8), a layer at a time."""
    layers = dict(params["layers"])
    for key in _LINEARS:
        layers.update(_int8_stacks(key, [quantize_weight(w, axis=0) for w in layers.pop(key)]))
    return {**params, "layers": layers}


def _int8_stacks(key: str, layers: list) -> dict:
    """Each layer's (int8 values, scales) of the linear `key` as two stacks: `key` and its
    scales'."""
    return {key: np.stack([values for values, _ in layers]),
            key + SCALE_SUFFIX: np.stack([scale for _, scale in layers])}


def _norm_weight(cfg: ModelConfig, w: np.ndarray, dtype) -> np.ndarray:
    """A norm's scale: w, or Gemma's (1 + w) in float32, as HF computes it whatever the
    model's dtype (kernels.rms_norm then scales in float32)."""
    if not cfg.norm_offset:
        return w.astype(dtype)
    return w.astype(np.float32) + np.float32(cfg.norm_offset)


def build_params(cfg: ModelConfig, get: GetTensor, dtype) -> dict:
    """`get(hf_name)` returns a float array; raises KeyError naming a missing tensor."""
    dtype = np.dtype(dtype)
    layers = {name: array for key, shape in expected_shapes(cfg).items()
              for name, array in _stacked(get, cfg, key, shape, dtype).items()}
    h = cfg.hidden_size
    params = {
        "embed": _checked(get, "model.embed_tokens.weight", (cfg.vocab_size, h)).astype(dtype),
        "layers": layers,
        "final_norm": _norm_weight(cfg, _checked(get, "model.norm.weight", (h,)), dtype),
    }
    if cfg.is_classifier:
        params["head"] = _checked(get, "score.weight", (cfg.num_labels, h)).astype(dtype)
    elif not cfg.tie_word_embeddings:
        params["head"] = _checked(get, "lm_head.weight", (cfg.vocab_size, h)).astype(dtype)
    return params


def param_shapes(cfg: ModelConfig) -> dict:
    """The shapes of `build_params`'s arrays, from the config alone (no checkpoint)."""
    h, n = cfg.hidden_size, cfg.num_layers
    layers = {key: (n, *(shape[::-1] if key in _LINEARS else shape))
              for key, shape in expected_shapes(cfg).items()}
    if cfg.quantization:
        layers.update({key + SCALE_SUFFIX: (n, shape[0])
                       for key, shape in expected_shapes(cfg).items() if key in _LINEARS})
    shapes = {"embed": (cfg.vocab_size, h), "layers": layers, "final_norm": (h,)}
    if cfg.is_classifier or not cfg.tie_word_embeddings:
        shapes["head"] = (cfg.output_size, h)
    return shapes


def param_dtype(cfg: ModelConfig, key: str, dtype) -> np.dtype:
    """The dtype of `build_params`'s array `key` (or `grouped_kv`'s) for a model in `dtype`:
    an int8 model's linears int8 with float32 scales, Gemma's norms float32."""
    if cfg.quantization and key in (*_LINEARS, KV_GROUP):
        return np.dtype(np.int8)
    if key.endswith(SCALE_SUFFIX) or (cfg.norm_offset and key in (*NORM_VECTORS, "final_norm")):
        return np.dtype(np.float32)
    return np.dtype(dtype)


def param_dtypes(cfg: ModelConfig, dtype) -> dict:
    """`param_dtype` of each array of `param_shapes`'s tree."""
    shapes = param_shapes(cfg)
    return {**{k: param_dtype(cfg, k, dtype) for k in shapes if k != "layers"},
            "layers": {k: param_dtype(cfg, k, dtype) for k in shapes["layers"]}}


def per_layer_matrices(params: dict) -> dict:
    """`params` with each layer's weight matrices as arrays of their own, [out, in], in
    "layer_matrices" (one dict per layer), and only the per-layer vectors left stacked in
    "layers". For XLA's CPU backend, which copies a weight sliced out of a stacked array before
    every dot, and whose dots run fastest as w [out, in] @ x [in, tokens] (model.decoder)."""
    layers = params["layers"]
    matrices = tuple({k: layers[k][i].T for k in _LINEARS} for i in range(len(layers["wq"])))
    vectors = {k: v for k, v in layers.items() if k not in _LINEARS}
    return {**params, "layers": vectors, "layer_matrices": matrices}


def grouped_kv(params: dict) -> dict:
    """`params` with k's and v's weights as one stack [layers, 2, in, out], KV_GROUP, as the
    TPU projection kernel reads them in one call. Stacked apart, XLA's memory-space assignment
    moved k's whole stack (56 MiB at Qwen3-0.6B's size), a kernel operand that fits VMEM, into
    VMEM in every layer (docs/tpu_v6e.md)."""
    layers = dict(params["layers"])
    layers[KV_GROUP] = np.stack([layers.pop("wk"), layers.pop("wv")], axis=1)
    return {**params, "layers": layers}


def grouped_kv_shapes(shapes: dict) -> dict:
    """`grouped_kv` on params' shapes (`param_shapes`)."""
    layers = dict(shapes["layers"])
    k, v = layers.pop("wk"), layers.pop("wv")
    if k != v:
        raise ValueError(f"k's weights {k} and v's {v} differ")
    layers[KV_GROUP] = (k[0], 2, *k[1:])
    return {**shapes, "layers": layers}


def head_weight(params: dict):
    """The output head [rows, H]: lm_head, the score head, or the tied embedding."""
    return params["head"] if "head" in params else params["embed"]
