"""Heads narrower than a lane tile (64 or 32 lanes), each in a lane tile of its own with zeros
after it: how the KV pool and the attention kernel hold them (model.decoder.pool_head_dim).
The projection kernels write q, k and v so, and read the attention's output so, in VMEM (a
roll and a select a vreg), where XLA would relay each whole array out in HBM (docs/tpu_v6e.md,
"Narrow heads each in a lane tile"). In a kernel: `head_tile`, `packed_heads`; in plain JAX,
their references: `heads_in_tiles`, `heads_from_tiles`."""
import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kernels.tpu_tiles import LANES


def tile_spread(head_dim: int, width: int) -> int:
    """How many times wider [T, width] of heads of `head_dim` lanes is with a lane tile a head
    (1 for head_dim 0: as they are); packed, `width` must be whole lane tiles."""
    if not head_dim:
        return 1
    if head_dim >= LANES or LANES % head_dim or width % LANES:
        raise ValueError(f"heads of {head_dim} lanes a lane tile each take a head dim dividing "
                         f"{LANES} and, packed, whole lane tiles (got {width} lanes)")
    return LANES // head_dim


def head_tile(y, k: int, head_dim: int):
    """Head k of y [rows, heads x head_dim] in a lane tile of its own, its lanes first."""
    per_tile = LANES // head_dim
    tile, shift = y[:, k // per_tile * LANES:(k // per_tile + 1) * LANES], k % per_tile
    if shift:
        tile = pltpu.roll(tile, LANES - shift * head_dim, 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    return jnp.where(lane < head_dim, tile, jnp.zeros_like(tile))


def packed_heads(x, head_dim: int):
    """x [rows, heads x 128], a head of `head_dim` lanes first in each tile, as [rows, heads x
    head_dim]; what lies after a head in its tile is not read."""
    per_tile = LANES // head_dim
    lane = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], LANES), 1)
    packed = []
    for first in range(0, x.shape[1] // LANES, per_tile):
        tile = x[:, first * LANES:(first + 1) * LANES]
        for k in range(1, per_tile):
            head = x[:, (first + k) * LANES:(first + k + 1) * LANES]
            tile = jnp.where(lane < k * head_dim, tile, pltpu.roll(head, k * head_dim, 1))
        packed.append(tile)
    return packed[0] if len(packed) == 1 else jnp.concatenate(packed, axis=1)


def heads_in_tiles(y, head_dim: int):
    """[T, heads x head_dim] -> [T, heads x 128], each head's lanes first in its tile."""
    heads = y.reshape(y.shape[0], -1, head_dim)
    return jnp.pad(heads, ((0, 0), (0, 0), (0, LANES - head_dim))).reshape(y.shape[0], -1)


def heads_from_tiles(x, head_dim: int):
    """[T, heads x 128] -> [T, heads x head_dim]: each tile's first head_dim lanes."""
    return x.reshape(x.shape[0], -1, LANES)[..., :head_dim].reshape(x.shape[0], -1)
