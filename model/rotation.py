"""An int8 model's residual stream in a rotated basis, and down's input in Hadamard blocks
(QuaRot's computational invariance): the same float model, whose activations have no outlier
channels left to set a token's int8 scale.

With a random orthogonal Q [H, H] the residual stream becomes x Q. A norm before a sublayer
commutes with Q once its scale is folded into the weights that read its output (RMS(x Q) =
RMS(x)), so q, k, v, gate and up read Q^T diag(norm) W, and o and down, which write the stream,
write W Q (o's bias b Q); the embeddings are E Q, and the head, which reads the final norm's
output, head diag(final norm) Q: nothing is added to the forward. A tied head becomes an array
of its own (a vocabulary's rows more in memory: a rotation in the forward instead cost the v6e
estimate a third more time, as XLA then moved 72 MB a layer; docs/tpu_v6e.md). Down's input h
is multiplied in the forward by a +-1 Hadamard matrix in blocks of n features
(kernels.int8.hadamard_blocks), its weights by the same over n: (h H)(H W / n) = h W.
"""
import numpy as np

from kernels.int8 import hadamard
from model.config import ModelConfig, rotatable
from model.params import head_weight

ROTATION_SEED = 0
READERS = {"attn_norm": ("wq", "wk", "wv"), "mlp_norm": ("w_gate", "w_up")}
WRITERS = ("wo", "w_down")


def rotation_matrix(size: int, seed: int = ROTATION_SEED) -> np.ndarray:
    """A random orthogonal matrix [size, size], float64: Q of a Gaussian's QR, its columns'
    signs set by R's diagonal (uniform over the orthogonal group)."""
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((size, size)))
    return q * np.sign(np.diag(r))


def rotated(cfg: ModelConfig, params: dict) -> dict:
    """`params` (stacked, linears [layers, in, out]) with the residual stream rotated: the
    linears that read or write it in float32, the norms that the weights after them took all
    ones, the embeddings and "head" (its own, even where the checkpoint ties it) in the
    embeddings' dtype."""
    if not rotatable(cfg):
        raise ValueError(f"{cfg.family}'s norms after its sublayers do not commute with a "
                         "rotation of the residual stream")
    q = rotation_matrix(cfg.hidden_size)
    layers = dict(params["layers"])
    for norm, readers in READERS.items():
        scales = layers[norm].astype(np.float64)
        for key in readers:
            layers[key] = _each_layer(layers[key], lambda w, i: q.T @ (scales[i][:, None] * w))
        layers[norm] = np.ones_like(layers[norm])
    for key in WRITERS:
        layers[key] = _each_layer(layers[key], lambda w, i: w @ q)
    if "bo" in layers:
        layers["bo"] = (layers["bo"].astype(np.float64) @ q).astype(layers["bo"].dtype)
    # a vocabulary's rows in float32 (float64 would take 8 bytes an element of two of them)
    embed, final_norm, q32 = params["embed"], params["final_norm"], q.astype(np.float32)
    head = head_weight(params).astype(np.float32) * final_norm.astype(np.float32)
    return {**params, "layers": layers, "embed": (embed.astype(np.float32) @ q32).astype(
        embed.dtype), "head": (head @ q32).astype(embed.dtype),
        "final_norm": np.ones_like(final_norm)}


def down_hadamard_folded(params: dict, block: int) -> dict:
    """`params` with down's weights [layers, I, H] multiplied by hadamard(block) / block in
    each run of `block` rows, in float32: what undoes the forward's Hadamard blocks on its
    input."""
    h = hadamard(block).astype(np.float64) / block
    layers = dict(params["layers"])
    layers["w_down"] = _each_layer(layers["w_down"], lambda w, i: np.einsum(
        "bc,gcn->gbn", h, w.reshape(-1, block, w.shape[1])).reshape(w.shape))
    return {**params, "layers": layers}


def _each_layer(stack: np.ndarray, fn) -> np.ndarray:
    """fn(layer's matrix in float64, layer index) of each layer, stacked in float32 (a layer
    at a time: a whole stack in float64 would take 4x its float32 bytes)."""
    return np.stack([fn(w.astype(np.float64), i).astype(np.float32)
                     for i, w in enumerate(stack)])
