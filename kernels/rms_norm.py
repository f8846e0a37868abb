import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """HF-style RMSNorm over `axis` (weight broadcasting against x): statistics in float32,
    result in the weight's dtype (Llama's); a float32 weight (Gemma's 1 + w, model.params)
    scales in float32 and the result takes x's dtype (Gemma's)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    if weight.dtype == jnp.float32:
        return (weight * xf).astype(x.dtype)
    return weight * xf.astype(weight.dtype)
