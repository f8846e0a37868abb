"""W8A8: symmetric int8 weights per output channel and activations per token, both rounded to
nearest (ties to even), and their products dequantized.

A weight's channel or an activation's token of all zeros gets scale 1 (its values stay 0): a
scale is never 0, so nothing divides by it. The XLA path computes exactly this, and the TPU
kernels must reproduce it.
"""
import jax
import jax.numpy as jnp
import numpy as np

INT8_MAX = 127
SCALE_SUFFIX = "_scale"  # params: a quantized weight `w`'s per-channel scales are `w_scale`
# The TPUs whose Pallas dots take int8 into int32 at the MXU's int8 rate: v5e, v5p and v6e
# (v4 has no such path; TPU7x multiplies fp8 instead)
INT8_TPU_KINDS = ("TPU v5", "TPU v6")


def int8_runs_on(device) -> bool:
    """Whether the int8 kernels run on `device`: any but a TPU outside INT8_TPU_KINDS (the
    XLA path, and the TPU interpreter, run anywhere)."""
    return device.platform != "tpu" or device.device_kind.startswith(INT8_TPU_KINDS)


def quantize_weight(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales) of `w`, one scale per slice along `axis`'s other axes:
    the contraction `axis` is reduced, so each output channel has its own."""
    w = np.asarray(w, np.float64)  # exact for float32 and bfloat16 weights
    absmax = np.max(np.abs(w), axis=axis, keepdims=True)
    scale = np.where(absmax > 0, absmax / INT8_MAX, 1.0)
    values = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return values, np.squeeze(scale, axis).astype(np.float32)


def quantize_tokens(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scales) of activations `x`, a scale per token: `axis` is the
    features' (1 token-major, 0 feature-major); the scales keep it as a size-1 axis."""
    # x's largest magnitude in its own dtype (exact; a TPU's vector unit takes two bfloat16s a
    # lane), the product in float32
    absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
    # times the reciprocal, a token's one division (on the TPU's vector units a division an
    # element costs several ops); |x| <= absmax keeps the product within a rounding of 127, so
    # nothing needs clipping, and int32 to int8 only packs (float32 to int8 directly clamps,
    # two more ops an element on a TPU)
    values = jnp.round(x.astype(jnp.float32) * (1.0 / scale)).astype(jnp.int32).astype(jnp.int8)
    return values, scale


def dequantized(acc: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                feature_major: bool) -> jax.Array:
    """An int32 product of int8 tokens and weights in float32: token-major acc [T, out] with
    x_scale [T, 1]; feature-major [out, T] with x_scale [1, T]; w_scale [out]."""
    w = w_scale[:, None] if feature_major else w_scale
    return acc.astype(jnp.float32) * x_scale * w.astype(jnp.float32)


def hadamard(n: int) -> np.ndarray:
    """Sylvester's n x n Hadamard matrix, entries +-1 (H = H^T, H H = n I); n a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix's size must be a power of 2, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_blocks(x: jax.Array, block: int, axis: int) -> jax.Array:
    """x times `hadamard(block)` in each run of `block` features, in x's dtype: `axis` is the
    features' (1 token-major, 0 feature-major). Before an int8 quantization it spreads a
    token's outlier features over their block, whose largest magnitude then sets a finer
    scale (an int8 model's down projection input: model.quantize)."""
    n = x.shape[axis]
    if n % block:
        raise ValueError(f"x of shape {x.shape} has {n} features along axis {axis}, not a "
                         f"multiple of the Hadamard block {block}")
    h = jnp.asarray(hadamard(block), x.dtype)  # +-1: exact in any float dtype
    blocks = (x.shape[0], n // block, block) if axis == 1 else (n // block, block, x.shape[1])
    spec = "tgb,bc->tgc" if axis == 1 else "gbt,bc->gct"
    y = jnp.einsum(spec, x.reshape(blocks), h, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape).astype(x.dtype)


def int8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    """Token-major x [T, in] @ a quantized weight (values [in, out] int8, scale [out]), float32:
    x quantized per token, the product accumulated in int32."""
    xq, x_scale = quantize_tokens(x, axis=1)
    acc = jnp.dot(xq, values, preferred_element_type=jnp.int32)
    return dequantized(acc, x_scale, scale, feature_major=False)
