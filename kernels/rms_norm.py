import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """HF-style RMSNorm over `axis` (weight broadcasting against x): statistics in float32,
    result in the weight's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    return weight * xf.astype(weight.dtype)
