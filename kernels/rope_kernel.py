"""q's and k's RMSNorm (Qwen3) and rotary embedding in the projections' layout: the Pallas TPU
kernel, and its plain-JAX reference.

The projections give q and k as [T, heads x head_dim], the layout the attention kernel reads.
XLA applied the norm and RoPE on [T, heads, head_dim] with the tables broadcast over heads
and the rotation as a concatenate, and moved the result back: a third of a Qwen3-0.6B layer's
estimated v6e time at 2048 tokens (docs/tpu_v6e.md). Here a grid step takes a block of
tokens of both arrays and treats them `lane_group(head_dim)` lanes at a time (a whole head,
or two heads of 64): the norm sums a head's lanes, and the rotation is lane rolls of the
group, weighted by per-token tables that the forward builds once for all layers. Where the
projections are kernels too, they apply the same lane-group code to their products in VMEM
(`HeadRope`, `norm_rope_lanes`) and this kernel does not run.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.rms_norm import rms_norm
from kernels.tpu_tiles import LANES, SUBLANES, row_block

_BLOCK_BYTES = 1 << 20  # of q a grid step reads: blocks of both arrays, double-buffered, stay
#                         well inside the default scoped VMEM


def lane_group(head_dim: int) -> int:
    """Lanes the kernel treats at once: one head of 128 or more, or the heads in 128 lanes."""
    if not rope_kernel_applies(head_dim, qk_norm=False):
        raise ValueError(f"head_dim {head_dim} must be even and divide or be a multiple of "
                         f"{LANES}")
    return max(head_dim, LANES)


def rope_kernel_applies(head_dim: int, qk_norm: bool) -> bool:
    """Whether the kernel takes these heads: a head a lane group or a whole part of one, and
    a norm (which sums a head's lanes) only on heads of whole lane tiles."""
    fits = head_dim % 2 == 0 and (head_dim % LANES == 0 or LANES % head_dim == 0)
    return fits and (not qk_norm or head_dim % LANES == 0)


def rope_angles(positions, head_dim: int, theta: float):
    """Each position's angle for each pair of a head's lanes, float32 [T, D/2]."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return positions.astype(jnp.float32)[:, None] * inv_freq[None, :]


def rope_lane_tables(positions, head_dim: int, theta: float):
    """(cos, signed sin), float32 [T, lane_group(head_dim)], each head's pattern repeated: a
    lane in a head's first half takes minus the sine (times the lane half a head above it),
    one in its second half plus the sine (times the lane half a head below)."""
    freqs = rope_angles(positions, head_dim, theta)
    cos = jnp.concatenate([jnp.cos(freqs)] * 2, axis=-1)
    sin = jnp.concatenate([-jnp.sin(freqs), jnp.sin(freqs)], axis=-1)
    repeats = lane_group(head_dim) // head_dim
    return jnp.tile(cos, (1, repeats)), jnp.tile(sin, (1, repeats))


def _rotated(x, head_dim: int):
    """Each lane's partner half a head away, within its head (x [rows, group])."""
    group, half = x.shape[-1], head_dim // 2
    if group == head_dim:
        return pltpu.roll(x, half, 1)
    first_half = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1), head_dim) < half
    return jnp.where(first_half, pltpu.roll(x, group - half, 1), pltpu.roll(x, half, 1))


def _normed(x, weight, eps: float, dtype):
    """RMSNorm over the lanes (one head) as `kernels.rms_norm`: statistics in float32, the
    product in the weight's dtype, or for a float32 weight (Gemma's 1 + w) in float32 rounded
    to the activations' `dtype`."""
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    if weight.dtype == jnp.float32:
        return (weight * x).astype(dtype).astype(jnp.float32)
    return (weight * x.astype(weight.dtype)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class HeadRope:
    """q's or k's norm and RoPE for a kernel that finishes q or k in VMEM (the projections'):
    the tables of `rope_lane_tables` [T, group], the norm's weight [head_dim] or None."""
    cos: jax.Array
    sin: jax.Array
    norm: jax.Array | None
    head_dim: int
    eps: float

    def check(self, tokens: int, width: int) -> None:
        group = lane_group(self.head_dim)
        if (width % group or self.cos.shape != (tokens, group)
                or self.sin.shape != (tokens, group)
                or (self.norm is not None and (self.norm.shape != (self.head_dim,)
                                               or self.head_dim % LANES))):
            raise ValueError(f"RoPE over [{tokens}, {width}] (whole groups of {group} lanes) "
                             f"takes tables [{tokens}, {group}] and a norm [head_dim] on "
                             f"heads of whole lane tiles, got cos {self.cos.shape}, sin "
                             f"{self.sin.shape}, norm {getattr(self.norm, 'shape', None)}, "
                             f"head_dim {self.head_dim}")


def norm_rope_lanes(x, cos, sin, weight, *, head_dim: int, eps: float, dtype):
    """One lane group of q or k (float32 [rows, group], of activations in `dtype`) normed over
    each head's lanes with `weight` [1, head_dim] (where given) and rotated by the tables'
    rows; float32 out. For this kernel and for others that finish q or k in VMEM (the
    projections')."""
    if weight is not None:
        x = _normed(x, weight, eps, dtype)
    return x * cos + _rotated(x, head_dim) * sin


def _kernel(*refs, head_dim: int, eps: float, norm: bool):
    if norm:
        q_ref, k_ref, cos_ref, sin_ref, q_w, k_w, q_out, k_out = refs
    else:
        (q_ref, k_ref, cos_ref, sin_ref, q_out, k_out), q_w, k_w = refs, None, None
    cos, sin = cos_ref[...], sin_ref[...]
    group = cos.shape[-1]
    for x_ref, w_ref, out in ((q_ref, q_w, q_out), (k_ref, k_w, k_out)):
        weight = None if w_ref is None else w_ref[...]
        for g in range(x_ref.shape[-1] // group):
            lanes = pl.ds(g * group, group)
            x = norm_rope_lanes(x_ref[:, lanes].astype(jnp.float32), cos, sin, weight,
                                head_dim=head_dim, eps=eps, dtype=out.dtype)
            out[:, lanes] = x.astype(out.dtype)


def rope_block_tokens(tokens: int, row_bytes: int) -> int:
    """The most tokens a step, a power of two dividing `tokens`, whose q block fits (all of
    them where no multiple of a tile's rows divides them)."""
    return row_block(tokens, lambda block: block * row_bytes <= _BLOCK_BYTES)


def check_rope_shapes(q, k, cos, sin, head_dim: int) -> None:
    group = lane_group(head_dim)
    t = q.shape[0]
    if (q.ndim != 2 or k.ndim != 2 or k.shape[0] != t or q.shape[1] % head_dim
            or k.shape[1] % head_dim or cos.shape != (t, group) or sin.shape != (t, group)):
        raise ValueError(f"expected q [T, Hq x {head_dim}], k [T, Hkv x {head_dim}] and "
                         f"tables [T, {group}], got q {q.shape}, k {k.shape}, cos {cos.shape},"
                         f" sin {sin.shape}")


def qk_norm_rope(q, k, cos, sin, q_norm=None, k_norm=None, *, head_dim: int, eps: float,
                 block_tokens: int | None = None, interpret=False):
    """q [T, Hq x D] and k [T, Hkv x D], each head RMS-normed over D with its weight [D] (where
    given: both or neither) and rotated by the tables of `rope_lane_tables`; same shapes and
    dtypes out. `block_tokens`: tokens a grid step (default: as many as fit)."""
    check_rope_shapes(q, k, cos, sin, head_dim)
    norms = _checked_norms(q_norm, k_norm, head_dim)
    widths, group = (q.shape[1], k.shape[1]), cos.shape[1]
    q, k = (_whole_groups(x, head_dim) for x in (q, k))
    tokens = q.shape[0]
    block = block_tokens or rope_block_tokens(tokens, q.shape[1] * q.dtype.itemsize)
    if tokens % block or (block % SUBLANES and block != tokens):
        raise ValueError(f"block_tokens {block} must divide the {tokens} tokens and be a "
                         f"multiple of {SUBLANES}")

    def rows(width):
        return pl.BlockSpec((block, width), lambda i: (i, 0))

    weight = pl.BlockSpec((1, head_dim), lambda i: (0, 0))
    q, k = pl.pallas_call(
        functools.partial(_kernel, head_dim=head_dim, eps=eps, norm=bool(norms)),
        name="qk_norm_rope", grid=(tokens // block,),
        in_specs=[rows(q.shape[1]), rows(k.shape[1]), rows(group), rows(group)]
        + [weight] * len(norms),
        out_specs=[rows(q.shape[1]), rows(k.shape[1])],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(q, k, cos, sin, *norms)
    return q[:, :widths[0]], k[:, :widths[1]]


def _checked_norms(q_norm, k_norm, head_dim: int) -> tuple:
    """The norm weights as the kernel takes them, [1, D] each, or () for none."""
    if q_norm is None and k_norm is None:
        return ()
    if (q_norm is None or k_norm is None or not rope_kernel_applies(head_dim, qk_norm=True)
            or q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,)):
        raise ValueError(f"norm weights q {getattr(q_norm, 'shape', None)}, k "
                         f"{getattr(k_norm, 'shape', None)}: both [head_dim], and head_dim "
                         f"({head_dim}) a multiple of {LANES}")
    return q_norm.reshape(1, head_dim), k_norm.reshape(1, head_dim)


def padded_width(width: int, head_dim: int) -> int:
    """The lanes of q or k as the kernel takes them: whole lane groups (a single head of 64
    takes 128, say)."""
    group = lane_group(head_dim)
    return -(-width // group) * group


def _whole_groups(x, head_dim: int):
    """x with zero lanes up to `padded_width`."""
    pad = padded_width(x.shape[1], head_dim) - x.shape[1]
    return jnp.pad(x, ((0, 0), (0, pad))) if pad else x


def qk_norm_rope_reference(q, k, cos, sin, q_norm=None, k_norm=None, *, head_dim: int,
                           eps: float, block_tokens: int | None = None, interpret=False):
    """Plain JAX, the same contract: the model's RMSNorm and rotate-half RoPE on [T, H, D]."""
    del block_tokens, interpret
    check_rope_shapes(q, k, cos, sin, head_dim)
    return (norm_rope_reference(q, cos, sin, q_norm, head_dim=head_dim, eps=eps),
            norm_rope_reference(k, cos, sin, k_norm, head_dim=head_dim, eps=eps))


def norm_rope_reference(x, cos, sin, norm=None, *, head_dim: int, eps: float):
    """x [T, H x D] (q or k) with each head RMS-normed (where `norm` [D] is given) and
    rotated by the tables of `rope_lane_tables`, in plain JAX: the model's ops on [T, H, D]."""
    half = head_dim // 2
    cos_d = cos[:, None, :head_dim]
    sin_d = jnp.concatenate([-sin[:, None, :half], sin[:, None, half:head_dim]], axis=-1)
    dtype, heads = x.dtype, x.reshape(x.shape[0], -1, head_dim)
    if norm is not None:
        heads = rms_norm(heads, norm, eps)
    rotated = jnp.concatenate([-heads[..., half:], heads[..., :half]], axis=-1)
    out = heads.astype(jnp.float32) * cos_d + rotated.astype(jnp.float32) * sin_d
    return out.astype(dtype).reshape(x.shape[0], -1)
