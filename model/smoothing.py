"""SmoothQuant for W8A8 where the residual stream cannot be rotated (model.quantize): a float
checkpoint's activations have outlier channels that set each token's int8 scale and leave the
others a few levels; each projection's input channel j is divided by a factor s_j and its
weight row multiplied by it, so that the float model computes the same and per-channel int8
weights take the outliers instead.

s_j = max|X_j| ** ALPHA / max|W_j| ** (1 - ALPHA) (SmoothQuant's; max|X_j| measured by a forward
over model.calibration_text), folded where the input is made: into the norm before q, k, v and
before gate and up; into v's output columns before o (one factor a KV head's channel, which
its query heads share); into up's columns before down (the activation multiplies up's
product, which stays linear in it).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels.ragged_paged_attention import AttentionMetadata
from model.batch import ForwardBatch
from model.calibration_text import CALIBRATION_TEXT
from model.config import ModelConfig
from model.decoder import empty_cache, hidden_states, model_kernels
from model.tokenizer import TextTokenizer

ALPHA = 0.5
SEQUENCES, SEQUENCE_TOKENS, PAGE_SIZE = 8, 256, 16
INPUTS = ("wq", "wo", "w_gate", "w_down")  # the dots whose inputs differ within a layer


def calibration_tokens(tokenizer: TextTokenizer) -> np.ndarray:
    """[SEQUENCES, SEQUENCE_TOKENS] token ids of the calibration text, repeated as needed."""
    ids = np.asarray(tokenizer.encode(CALIBRATION_TEXT), np.int32)
    return np.resize(ids, SEQUENCES * SEQUENCE_TOKENS).reshape(SEQUENCES, SEQUENCE_TOKENS)


def activation_absmax(cfg: ModelConfig, params: dict, tokens: np.ndarray) -> dict:
    """The largest |x| of each input channel of INPUTS' dots over the sequences `tokens`
    [S, n], by layer: name -> [layers, in] float32. `params` stacked and in float."""
    s, n = tokens.shape
    if n % PAGE_SIZE:
        raise ValueError(f"calibration sequences of {n} tokens, not a multiple of {PAGE_SIZE}")
    pages = n // PAGE_SIZE
    attention = AttentionMetadata(
        cu_q_lens=np.arange(s + 1, dtype=np.int32) * n, kv_lens=np.full(s, n, np.int32),
        page_indices=np.arange(s * pages, dtype=np.int32).reshape(s, pages),
        shared_lens=np.zeros(s, np.int32), visible_from=np.zeros(s * n, np.int32))
    batch = ForwardBatch(tokens.reshape(-1), np.tile(np.arange(n, dtype=np.int32), s),
                         attention, *(None,) * 5)
    cache = empty_cache(cfg, s * pages, PAGE_SIZE, params["embed"].dtype, "reference")
    kernels = model_kernels(cfg, "reference", max_q_len=s * n, sizes=None)
    found = {}

    def record(name, layer, absmax):
        key = (name, int(layer))
        found[key] = np.maximum(found.get(key, 0.0), absmax)

    def observe(name, layer, x):
        if name in INPUTS:
            jax.debug.callback(functools.partial(record, name), layer,
                               jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0))

    forward = jax.jit(functools.partial(hidden_states, cfg=cfg, kernels=kernels,
                                        observe=observe))
    jax.block_until_ready(forward(params, cache=cache, batch=batch))
    jax.effects_barrier()
    return {name: np.stack([found[(name, i)] for i in range(cfg.num_layers)])
            for name in INPUTS}


def smoothing_factors(cfg: ModelConfig, params: dict, absmax: dict,
                      alpha: float = ALPHA) -> dict:
    """s by what it divides, [layers, channels]: "qkv" and "gate_up" the inputs of those
    projections, "down" down's, "v" v's output columns (o's input channels, by KV head)."""
    layers, n = params["layers"], cfg.num_layers

    def weight_absmax(*keys):  # [layers, in]
        return np.max([np.abs(layers[k].astype(np.float32)).max(axis=2) for k in keys], axis=0)

    by_kv_head = (n, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    o_in = [a.reshape(by_kv_head).max(axis=2).reshape(n, -1)
            for a in (absmax["wo"], weight_absmax("wo"))]
    return {"qkv": _factors(absmax["wq"], weight_absmax("wq", "wk", "wv"), alpha),
            "gate_up": _factors(absmax["w_gate"], weight_absmax("w_gate", "w_up"), alpha),
            "down": _factors(absmax["w_down"], weight_absmax("w_down"), alpha),
            "v": _factors(*o_in, alpha)}


def _factors(x_absmax, w_absmax, alpha: float):
    """1 where a channel's activations or weights are all zero (nothing to move)."""
    x, w = np.maximum(x_absmax, 1e-30), np.maximum(w_absmax, 1e-30)
    s = x ** alpha / w ** (1 - alpha)
    return np.where((x_absmax > 0) & (w_absmax > 0), s, 1.0).astype(np.float32)


def smoothed(cfg: ModelConfig, params: dict, factors: dict) -> dict:
    """`params` with `factors` folded in: the same float model; the linears in float32 (to be
    quantized next), the norms and v's bias in their dtypes."""
    layers = dict(params["layers"])
    rep = cfg.num_heads // cfg.num_kv_heads
    o_rows = np.repeat(factors["v"].reshape(cfg.num_layers, cfg.num_kv_heads, 1, -1), rep,
                       axis=2).reshape(cfg.num_layers, -1)

    def scale(key, by, where):  # `by` [layers, channels] broadcast at `where`
        layers[key] = (layers[key].astype(np.float32) * np.expand_dims(by, where)).astype(
            layers[key].dtype if key.endswith("norm") or key == "bv" else np.float32)

    for key, by, where in (
            ("attn_norm", 1 / factors["qkv"], ()), ("wq", factors["qkv"], 2),
            ("wk", factors["qkv"], 2), ("wv", factors["qkv"], 2),
            ("mlp_norm", 1 / factors["gate_up"], ()), ("w_gate", factors["gate_up"], 2),
            ("w_up", factors["gate_up"], 2), ("w_up", 1 / factors["down"], 1),
            ("w_down", factors["down"], 2), ("wv", 1 / factors["v"], 1),
            ("wo", o_rows, 2)):
        scale(key, by, where)
    if "bv" in layers:
        scale("bv", 1 / factors["v"], ())
    return {**params, "layers": layers}
