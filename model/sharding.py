"""Tensor parallelism over one mesh axis, Megatron style, with the forward inside a shard_map.

Per layer, q/k/v, gate and up are split by columns (attention heads, the intermediate size),
o and down by rows, so each block ends in one all-reduce. KV pages are split by KV head; when
there are fewer KV heads than shards, each is repeated so that every shard holds the head its
query heads read. The embedding and an LM head are split by vocabulary rows: a token's
embedding and a label's logit come from the shard holding that row, and the logsumexp from the
shards' partial ones, max-shifted. A classifier's head is a few rows: every shard holds it.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.int8 import SCALE_SUFFIX
from model.batch import KVCache
from model.config import ModelConfig
from model.params import KV_GROUP

TP_AXIS = "tp"
_COLUMNS = ("wq", "wk", "wv", "w_gate", "w_up")  # stacked [layers, in, out]: split out
_GROUPED_COLUMNS = (KV_GROUP,)                     # [layers, n, in, out]: split out
_ROWS = ("wo", "w_down")                          # split in
_BIASES = ("bq", "bk", "bv")                       # [layers, out]
_COLUMN_SCALES = tuple(k + SCALE_SUFFIX for k in _COLUMNS)  # an int8 model's, [layers, out]
_KV = ("wk", "wv", "bk", "bv", "wk" + SCALE_SUFFIX, "wv" + SCALE_SUFFIX)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    tp: int = 1
    kv_repeat: int = 1            # copies of each KV head, when there are fewer than tp
    vocab_parallel: bool = False  # the embedding split by vocabulary rows
    head_parallel: bool = False   # the output head too (an LM head, not a classifier's)

    @property
    def sharded(self) -> bool:
        return self.tp > 1


def tp_mesh(devices) -> Mesh:
    """One device group: a mesh of its devices along TP_AXIS (one device: a mesh of one)."""
    return Mesh(np.array(devices), (TP_AXIS,))


def shard_plan(cfg: ModelConfig, tp: int) -> ShardPlan:
    """Raises ValueError when `cfg` cannot be split `tp` ways."""
    if tp < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp}")
    if tp > 1 and cfg.quantization:
        # a row-split projection's tokens would be quantized by each shard's part of the row
        raise ValueError(f"--quantization {cfg.quantization} is not supported with --tp-size "
                         f"> 1 yet: use --tp-size 1 (and --dp-size for more devices)")
    for name in ("num_heads", "intermediate_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"--tp-size {tp} does not divide {name}={getattr(cfg, name)}")
    hkv = cfg.num_kv_heads
    if hkv % tp and tp % hkv:
        raise ValueError(f"--tp-size {tp} and num_kv_heads={hkv}: one must divide the other")
    vocab = tp > 1 and cfg.vocab_size % tp == 0
    return ShardPlan(tp, max(1, tp // hkv), vocab, vocab and not cfg.is_classifier)


def repeat_kv_heads(params: dict, cfg: ModelConfig, repeat: int) -> dict:
    """Host params with each KV head's columns repeated `repeat` times, side by side."""
    if repeat == 1:
        return params

    def repeated(w):
        heads = w.reshape(*w.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        return np.repeat(heads, repeat, axis=-2).reshape(*w.shape[:-1], -1)

    layers = {k: repeated(w) if k in _KV else w for k, w in params["layers"].items()}
    return {**params, "layers": layers}


def repeat_kv_shapes(shapes: dict, repeat: int) -> dict:
    """`repeat_kv_heads` on params' shapes (model.params.param_shapes)."""
    layers = {k: (*s[:-1], s[-1] * repeat) if k in _KV else s
              for k, s in shapes["layers"].items()}
    return {**shapes, "layers": layers}


def param_specs(params: dict, shards: ShardPlan) -> dict:
    def layer_spec(key):
        if key in _COLUMNS:
            return P(None, None, TP_AXIS)
        if key in _GROUPED_COLUMNS:
            return P(None, None, None, TP_AXIS)
        if key in _ROWS:
            return P(None, TP_AXIS, None)
        return P(None, TP_AXIS) if key in _BIASES + _COLUMN_SCALES else P()

    specs = {"layers": {k: layer_spec(k) for k in params["layers"]}, "final_norm": P(),
             "embed": P(TP_AXIS) if shards.vocab_parallel else P()}
    if "layer_matrices" in params:  # one layer's, [out, in]: no leading layer axis
        specs["layer_matrices"] = tuple({k: P(*reversed(layer_spec(k)[1:])) for k in matrices}
                                        for matrices in params["layer_matrices"])
    if "head" in params:
        specs["head"] = P(TP_AXIS) if shards.head_parallel else P()
    return specs


CACHE_SPECS = KVCache(P(None, TP_AXIS), P(None, TP_AXIS))  # [layers, Hkv, pages, page, D]


def _row_major(mesh: Mesh, spec: P, ndim: int) -> Format:
    return Format(Layout(tuple(range(ndim))), NamedSharding(mesh, spec))


def param_placements(params: dict, shards: ShardPlan, mesh: Mesh) -> dict:
    """Each param's sharding on `mesh`. The output head is also pinned row-major: the label
    gather kernels read its rows from HBM, and XLA would store a head whose width is no
    multiple of 128 lanes transposed, then transpose it back for every forward."""
    specs = param_specs(params, shards)
    placements = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                              is_leaf=lambda x: isinstance(x, P))
    head = "head" if "head" in params else "embed"
    placements[head] = _row_major(mesh, specs[head], 2)
    return placements


def cache_placements(mesh: Mesh) -> KVCache:
    """Pages row-major, as the Pallas kernels DMA them (see model.decoder.pool_head_dim)."""
    return KVCache(*(_row_major(mesh, spec, 5) for spec in CACHE_SPECS))


def all_reduce(x, shards: ShardPlan):
    return jax.lax.psum(x, TP_AXIS) if shards.sharded else x


def _local_rows(ids, rows: int):
    """Ids relative to this shard's slice of `rows` rows, clamped, and whether they are in it."""
    local = ids - jax.lax.axis_index(TP_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    return jnp.clip(local, 0, rows - 1), mine


def embed_tokens(embed, tokens, shards: ShardPlan):
    if not shards.vocab_parallel:
        return embed[tokens]
    local, mine = _local_rows(tokens, embed.shape[0])
    return jax.lax.psum(jnp.where(mine[:, None], embed[local], 0), TP_AXIS)


def gather_labels(gather, hidden, norm, head, label_ids, shards: ShardPlan, **kw):
    """`gather` (a label-gather kernel) over a vocabulary-split head: each label's logit from
    its shard; the logsumexp from the shards' ones, shifted by their max."""
    if not shards.head_parallel:
        return gather(hidden, norm, head, label_ids, **kw)
    local, mine = _local_rows(label_ids, head.shape[0])
    logits, lse = gather(hidden, norm, head, local, **kw)
    logits = jax.lax.psum(jnp.where(mine, logits, 0.0), TP_AXIS)
    if lse is None:
        return logits, None
    top = jax.lax.pmax(lse, TP_AXIS)
    return logits, top + jnp.log(jax.lax.psum(jnp.exp(lse - top), TP_AXIS))


def shard_forward(forward, mesh, params: dict, shards: ShardPlan):
    """`forward(params, cache, batch)` as one SPMD program over `mesh`'s TP_AXIS: params and
    cache split as planned, the batch and the label logits the same on every shard."""
    return jax.shard_map(forward, mesh=mesh, in_specs=(param_specs(params, shards), CACHE_SPECS,
                                                       P()),
                         out_specs=(P(), P(), CACHE_SPECS), check_vma=False)
