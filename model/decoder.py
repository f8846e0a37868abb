"""Pure functional decoder for the Llama, Qwen2, Qwen3, Mistral and Gemma 1-3 families (their
differences: model.config.ModelConfig's fields).

params (see model.params) + config + ForwardBatch + KV cache -> label logits of the scored rows.
The layers' weights are stacked and scanned, so compile time does not grow with depth (on
CPU, the matrices are one array per layer, [out, in], and a switch in the scan picks them).
Activations are token-major, [tokens, features], except in CPU programs of up to
FEATURE_MAJOR_MAX_TOKENS tokens, which keep them feature-major, [features, tokens], around
the dots (docs/performance_cpu.md, "Forward per bucket").
"""
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kernels.attention_plan import BlockSizes, plan_attention
from kernels.int8 import (
    SCALE_SUFFIX,
    dequantized,
    hadamard_blocks,
    int8_matmul,
    quantize_tokens,
)
from kernels.backends import TPU_BACKENDS, KernelSet, select_kernels
from kernels.mlp_kernel import mlp_kernel_applies
from kernels.ragged_paged_attention import page_blocks, written_pages
from kernels.projection_kernel import (
    ACTIVATIONS,
    InputNorm,
    PageWrite,
    norm_fits,
    projection_kernel_applies,
)
from kernels.rms_norm import rms_norm
from kernels.rope_kernel import HeadRope, rope_angles, rope_kernel_applies, rope_lane_tables
from kernels.tpu_tiles import lane_aligned
from model.batch import ForwardBatch, KVCache
from model.config import ModelConfig
from model.params import KV_GROUP, head_weight
from model.sharding import ShardPlan, all_reduce, embed_tokens, gather_labels

FEATURE_MAJOR_MAX_TOKENS = 512
PROJECTION_WEIGHTS = ("wq", "wk", "wv", KV_GROUP, "wo", "w_gate", "w_up", "w_down")
KV_WEIGHTS = ("wk", "wv")  # in KV_GROUP, in this order (model.params.grouped_kv)
MLP_WEIGHTS = ("w_gate", "w_up", "w_down")  # the MLP kernel's, in this order
ROTATED_PROJECTIONS = ("project_q", "project_kv")  # calls that norm and rotate q's or k's heads


def rope_tables(positions, head_dim: int, theta: float, feature_major: bool = False):
    """cos and sin of each position's angles, laid out for `apply_rope`: [T, 1, D], or
    feature-major [2, D/2, T] with the sin's first half negated."""
    freqs = rope_angles(positions, head_dim, theta)
    if feature_major:
        cos, sin = jnp.cos(freqs.T), jnp.sin(freqs.T)
        return jnp.stack([cos, cos]), jnp.stack([-sin, sin])
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin, feature_major: bool = False):
    """Rotate-half RoPE of x [T, H, D], or feature-major [H, D, T]: there the halves times cos,
    plus the halves swapped (a flip of the axis of two) times the signed sin."""
    if feature_major:
        h, d, t = x.shape
        halves = x.reshape(h, 2, d // 2, t).astype(jnp.float32)
        return (halves * cos + jnp.flip(halves, 1) * sin).reshape(x.shape).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


Dot = Callable  # (x, name, epilogue, operands) -> epilogue(x @ this layer's weight `name`,
#                  *operands) (w @ x feature-major), float32
Observe = Callable  # (name, layer, x) -> None: sees each dot's input x [T, in] in a forward
#                      (model.smoothing's calibration)


def _product(y):
    return y


def _layer_dot(lp: dict, matrices: tuple | None, layer, feature_major: bool,
               observe: Observe | None = None) -> Dot:
    """Matmuls with this layer's weights: sliced out of the stacked params (`lp`, [in, out]),
    or, with per-layer matrices (model.params.per_layer_matrices, [out, in]), a switch on the
    layer whose branches each read their own array, so that no weight is copied first. An
    `epilogue` runs on the product inside the branch, where XLA fuses it with nothing after
    the switch. An int8 weight (its scales `lp[name + SCALE_SUFFIX]`) multiplies x quantized
    per token, and its int32 product is dequantized before the epilogue (kernels.int8)."""
    def stacked(x, name, epilogue=_product, operands=()):
        if observe is not None:
            observe(name, layer, x)
        scale = lp.get(name + SCALE_SUFFIX)
        y = (jnp.dot(x, lp[name], preferred_element_type=jnp.float32) if scale is None
             else int8_matmul(x, lp[name], scale))
        return epilogue(y, *operands)

    def per_layer(x, name, epilogue=_product, operands=()):
        if observe is not None:
            observe(name, layer, x.T if feature_major else x)
        scale = lp.get(name + SCALE_SUFFIX)
        if scale is not None:
            x, x_scale = quantize_tokens(x, axis=0 if feature_major else 1)
            epilogue, operands = (_dequantizing(epilogue, feature_major),
                                  (x_scale, scale, *operands))
        branches = _dot_branches(len(matrices), feature_major, epilogue)
        return jax.lax.switch(layer, branches, x, tuple(m[name] for m in matrices), *operands)

    return stacked if matrices is None else per_layer


@functools.cache
def _dequantizing(epilogue: Callable, feature_major: bool) -> Callable:
    """`epilogue` after an int32 product's dequantization: one function a pair (a branch's
    trace is reused, `_dot_branches`)."""
    return functools.partial(_dequantized_epilogue, epilogue, feature_major)


def _dequantized_epilogue(epilogue: Callable, feature_major: bool, acc, x_scale, w_scale,
                          *operands):
    return epilogue(dequantized(acc, x_scale, w_scale, feature_major), *operands)


@functools.cache
def _dot_branches(num_layers: int, feature_major: bool, epilogue: Callable) -> tuple:
    """The same branch functions every time: JAX reuses a branch's trace for the same function
    and operand shapes (each projection of a program, and the programs of one bucket)."""
    dot = _dot_feature_major if feature_major else _dot_token_major
    return tuple(functools.partial(_branch, dot, epilogue, n) for n in range(num_layers))


def _branch(dot: Callable, epilogue: Callable, n: int, x, weights: tuple, *operands):
    return epilogue(dot(n, x, weights), *operands)


def _dot_token_major(n: int, x, weights: tuple):
    """x [T, in] . weights[n] [out, in] -> [T, out] (int8's in int32)."""
    return jax.lax.dot_general(x, weights[n], (((1,), (1,)), ((), ())),
                               preferred_element_type=_accumulator(x))


def _dot_feature_major(n: int, x, weights: tuple):
    """weights[n] [out, in] . x [in, T] -> [out, T] (int8's in int32)."""
    return jax.lax.dot_general(weights[n], x, (((1,), (0,)), ((), ())),
                               preferred_element_type=_accumulator(x))


def _accumulator(x):
    return jnp.int32 if x.dtype == jnp.int8 else jnp.float32


def _project(dot: Dot, x, name: str, bias=None, shards: ShardPlan | None = None,
             feature_major: bool = False):
    """x @ w (+ bias); with `shards`, w is split by rows and the partial sums are all-reduced."""
    return _finished(dot(x, name), x.dtype, bias, shards, feature_major)


def _finished(y, dtype, bias=None, shards: ShardPlan | None = None,
              feature_major: bool = False):
    if shards is not None:
        y = all_reduce(y, shards)
    if bias is not None:
        y = y + (bias[:, None] if feature_major else bias).astype(jnp.float32)
    return y.astype(dtype)


Project = Callable  # (x, pairs, call, shards=None, rope=None, pages=None, residual=None,
#                      x_norm=None, tile_heads=0, x_tile_heads=0) -> x @ each (weight, bias)
#                      pair's weight (+ its bias, where the model has it) in x's dtype (with
#                      `residual`, one pair's, added to it); with `shards` the weights are split
#                      by rows and the partial sums all-reduced. `call` names a kernel call (one
#                      for all the pairs). The kernel's only: `rope`
#                      (kernels.rope_kernel.HeadRope), the first product's heads normed and
#                      rotated in the kernel; `pages` (kernels.projection_kernel.PageWrite), k's
#                      and v's products written into the pools it returns; `x_norm` (InputNorm),
#                      x RMS-normed first; `tile_heads`, `x_tile_heads`: the outputs' or x's
#                      heads of that many lanes a lane tile each (kernels.head_tiles).


def _layer_projections(kernels: KernelSet, lp: dict, stacked: dict, layer, dot: Dot,
                       feature_major: bool) -> Project:
    """On the projection kernel where the backend has one (reading `layer`'s weights from
    the `stacked` weights), else XLA's dots, one a pair or one for k and v where their weights
    are one stack (two would each read a layer's group, which XLA then copies out of the
    stack first)."""
    if kernels.project is not None:
        return functools.partial(_kernel_projections, kernels.project, lp, stacked, layer)

    def xla(x, pairs, call, shards=None, rope=None, residual=None, x_norm=None,
            x_tile_heads=0):
        del call
        if rope is not None or x_norm is not None or x_tile_heads:
            raise ValueError("RoPE, x's norm and heads a lane tile each in the projections "
                             "need the projection kernel")
        if tuple(w for w, _ in pairs) == KV_WEIGHTS and KV_GROUP in lp:
            return tuple(_finished(y, x.dtype, lp.get(b), shards)
                         for y, (_, b) in zip(_kv_products(x, lp), pairs))
        return _plus(residual, tuple(_project(dot, x, w, lp.get(b), shards, feature_major)
                                     for w, b in pairs))
    return xla


def _kv_products(x, lp: dict) -> tuple:
    """k's and v's float32 products from their group [in, 2, out] in one dot (an int8
    group's of x quantized per token, each dequantized by its own scales)."""
    scales = _scales(lp, KV_WEIGHTS)
    if scales:
        x, x_scale = quantize_tokens(x, axis=1)
    both = jax.lax.dot_general(x, lp[KV_GROUP], (((1,), (1,)), ((), ())),
                               preferred_element_type=_accumulator(x))  # [T, 2, out]
    if not scales:
        return both[:, 0], both[:, 1]
    return tuple(dequantized(both[:, i], x_scale, s, feature_major=False)
                 for i, s in enumerate(scales))


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int, int]]:
    """(in, out, weights of that shape, outputs) of each projection kernel call of a layer,
    by its name, unsharded: gate and up give one output, their SiLU product."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    return {"project_q": (hidden, q, 1, 1), "project_kv": (hidden, kv, 2, 2),
            "project_out": (q, hidden, 1, 1), "gate_up": (hidden, inner, 2, 1),
            "project_down": (inner, hidden, 1, 1)}


def _kernel_projections(kernel: Callable, lp: dict, stacked: dict, layer, x, pairs, call: str,
                        shards=None, rope=None, pages: PageWrite | None = None,
                        residual=None, x_norm: InputNorm | None = None, tile_heads: int = 0,
                        x_tile_heads: int = 0):
    """Split weights give float32 partial sums, all-reduced before the bias (as XLA's dots)
    and the residual; RoPE and pages take whole products (q's, k's and v's projections are
    split by columns, not rows)."""
    weights = _call_weights(stacked, tuple(w for w, _ in pairs))
    biases = tuple(lp[b] for _, b in pairs if b in lp)
    scales = _scales(lp, tuple(w for w, _ in pairs))
    if pages is not None or tile_heads:
        return kernel(x, weights, biases, layer=layer, rope=rope, pages=pages, x_norm=x_norm,
                      scales=scales, name=call, tile_heads=tile_heads)
    if shards is None or not shards.sharded:
        return kernel(x, weights, biases, layer=layer, rope=rope, residual=residual,
                      x_norm=x_norm, scales=scales, name=call, x_tile_heads=x_tile_heads)
    if rope is not None or x_norm is not None:
        raise ValueError("RoPE and x's norm need whole products, not a row-split "
                         "projection's")
    sums = kernel(x, weights, layer=layer, out_dtype=jnp.float32, scales=scales, name=call,
                  x_tile_heads=x_tile_heads)
    return _plus(residual, tuple(_finished(y, x.dtype, lp.get(b), shards)
                                 for y, (_, b) in zip(sums, pairs)))


def _plus(residual, outs: tuple) -> tuple:
    """The product added to the residual stream, where there is one (one product)."""
    return outs if residual is None else (residual + outs[0],)


def _scales(lp: dict, names: tuple) -> tuple:
    """An int8 model's scales of the weights `names` at the layer (none for a float model)."""
    return tuple(lp[n + SCALE_SUFFIX] for n in names if n + SCALE_SUFFIX in lp)


def _call_weights(stacked: dict, names: tuple) -> tuple:
    """The stacks a kernel call reads: k's and v's as their group, where they are one."""
    if names == KV_WEIGHTS and KV_GROUP in stacked:
        return (stacked[KV_GROUP],)
    return tuple(stacked[n] for n in names)


def _head_ropes(cfg: ModelConfig, kernels: KernelSet, lp: dict, cos, sin) -> tuple:
    """q's and k's norm and RoPE for their projection kernels (None, None: not there)."""
    if kernels.rope is None or kernels.project is None:
        return None, None
    norms = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else (None, None)
    return tuple(HeadRope(cos, sin, n, cfg.head_dim, cfg.rms_norm_eps) for n in norms)


def _qkv(cfg: ModelConfig, kernels: KernelSet, project: Project, lp: dict, h, h_norm, cos,
         sin):
    """q, k, v token-major [T, heads, D] (this shard's heads) of h (`h_norm`: its norm, for
    the kernels to apply). q's and k's norm and RoPE: in the projection kernels where the
    backend has them and the norm and RoPE kernel, else in that kernel (both on the
    projections' layout, with `rope_lane_tables`), else XLA's ops."""
    norms = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else (None, None)
    q_rope, k_rope = _head_ropes(cfg, kernels, lp, cos, sin)
    in_projections = q_rope is not None
    q_call, kv_call = ROTATED_PROJECTIONS
    (q,) = project(h, (("wq", "bq"),), q_call, rope=q_rope, x_norm=h_norm)
    k, v = project(h, (("wk", "bk"), ("wv", "bv")), kv_call, rope=k_rope, x_norm=h_norm)
    if kernels.rope is not None and not in_projections:
        q, k = kernels.rope(q, k, cos, sin, *norms if cfg.qk_norm else (),
                            head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
    q, k, v = (y.reshape(h.shape[0], -1, cfg.head_dim) for y in (q, k, v))
    if kernels.rope is None:
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v


def _q_and_kv_pages(cfg: ModelConfig, kernels: KernelSet, project: Project, lp: dict, h,
                    h_norm, cos, sin, cache: KVCache, blocks: "_BlockPages"):
    """q [T, heads, the pool's D], and the pools with k's and v's products written into their
    pages by their projection (normed and rotated there too): no k or v array, no gather.
    Heads narrower than the pool's lane tile go each into a tile of their own there (no pad,
    no relayout between the projections and the attention)."""
    q_rope, k_rope = _head_ropes(cfg, kernels, lp, cos, sin)
    q_call, kv_call = ROTATED_PROJECTIONS
    d = cache.k.shape[-1]
    tile_heads = tiled_head_dim(cfg, d)
    (q,) = project(h, (("wq", "bq"),), q_call, rope=q_rope, x_norm=h_norm,
                   tile_heads=tile_heads)
    k_pages, v_pages = project(h, (("wk", "bk"), ("wv", "bv")), kv_call, rope=k_rope,
                               pages=PageWrite(cache.k, cache.v, blocks.ids), x_norm=h_norm,
                               tile_heads=tile_heads)
    return q.reshape(h.shape[0], -1, d), k_pages, v_pages


def _qkv_feature_major(cfg: ModelConfig, lp: dict, dot: Dot, h, cos, sin):
    """The bias, q/k norms and RoPE run in the dot's branch on the heads [H, D, T], and what
    leaves the branch is only transposed: XLA CPU transposes as fast as it copies, but a
    transpose fused with RoPE ran element by element (1 ms a layer for a 512-token q, where
    the branch's RoPE and the transpose take 0.1 ms; docs/performance_cpu.md, "Forward per
    bucket")."""
    heads = _heads_epilogue(cfg.head_dim, cfg.rms_norm_eps)

    def project(name, bias, norm=None, tables=(None, None)):
        y = dot(h, name, heads, (lp.get(bias), norm, *tables))
        return y.transpose(2, 0, 1).astype(h.dtype)

    q_norm, k_norm = (lp[n] if cfg.qk_norm else None for n in ("q_norm", "k_norm"))
    return (project("wq", "bq", q_norm, (cos, sin)), project("wk", "bk", k_norm, (cos, sin)),
            project("wv", "bv"))


@functools.cache
def _heads_epilogue(head_dim: int, eps: float) -> Callable:
    return functools.partial(_heads_feature_major, head_dim=head_dim, eps=eps)


def _heads_feature_major(y, bias, norm, cos, sin, *, head_dim: int, eps: float):
    """A feature-major product [H x D, T] as heads [H, D, T], with the bias, the RMSNorm over
    D and RoPE, each where given (float32)."""
    if bias is not None:
        y = y + bias[:, None].astype(jnp.float32)
    y = y.reshape(-1, head_dim, y.shape[-1])
    if norm is not None:
        y = rms_norm(y, norm[:, None].astype(jnp.float32), eps, axis=1)
    return y if cos is None else apply_rope(y, cos, sin, feature_major=True)


def _mlp(activation: Callable, project: Project, gated_up: Callable | None, h,
         shards: ShardPlan, residual, spread: Callable | None = None):
    """`residual` plus the MLP of h (None: the MLP alone). `gated_up`: h -> activation(h @
    w_gate) * (h @ w_up) in one kernel; None: XLA's ops, with `activation` (of ACTIVATIONS).
    `spread`: what down's input goes through first (an int8 model's Hadamard blocks)."""
    if gated_up is None:
        gate, up = project(h, (("w_gate", None), ("w_up", None)), "gate_up")
        h = activation(gate.astype(jnp.float32)).astype(up.dtype) * up
    else:
        h = gated_up(h)
    if spread is not None:
        h = spread(h)
    return project(h, (("w_down", None),), "project_down", shards, residual=residual)[0]


def _mlp_kernel(cfg: ModelConfig, mlp: Callable, lp: dict, stacked: dict, layer, x,
                x_norm: InputNorm, shards: ShardPlan):
    """x plus its MLP in one kernel (kernels.mlp_kernel), the weights read from the stacks at
    the layer; a row-split down projection's float32 partial sums all-reduced before the
    residual add, as the projections' (`_kernel_projections`)."""
    weights, int8 = _mlp_weights(stacked), _mlp_int8(cfg, lp, MLP_WEIGHTS)
    if not shards.sharded:
        return mlp(x, *weights, layer=layer, x_norm=x_norm, residual=x, name="mlp", **int8)
    sums = mlp(x, *weights, layer=layer, x_norm=x_norm, out_dtype=jnp.float32, name="mlp",
               **int8)
    return _plus(x, (_finished(sums, x.dtype, None, shards),))[0]


def _mlp_weights(stacked: dict) -> tuple:
    return tuple(stacked[w] for w in MLP_WEIGHTS)


def _mlp_int8(cfg: ModelConfig, lp: dict, names: tuple) -> dict:
    """The MLP kernel's int8 arguments: the weights' scales at the layer, down's input's
    Hadamard blocks (none for a float model)."""
    return {"scales": _scales(lp, names), "hadamard": cfg.down_hadamard}


def _mlp_kernels(kernels: KernelSet, cfg: ModelConfig, stacked: dict, layer_params: dict,
                 tokens: int, shards: ShardPlan) -> KernelSet:
    """The MLP's kernel where it takes this shard's weights, after the output projection
    where those fit too and the layer has no output bias, on one chip (else the output
    projection's row-split partial sums are all-reduced before its residual add)."""
    if kernels.project is None or cfg.activation != "silu" or cfg.sandwich_norms:
        return kernels._replace(mlp=None, out_and_mlp=None)  # SiLU's, adding the residual
    itemsize, inner = stacked["w_gate"].dtype.itemsize, stacked["w_gate"].shape[-1]
    if not mlp_kernel_applies(tokens, cfg.hidden_size, inner, itemsize):
        return kernels._replace(mlp=None, out_and_mlp=None)
    if (shards.sharded or "bo" in layer_params
            or not mlp_kernel_applies(tokens, cfg.hidden_size, inner, itemsize,
                                      stacked["wo"].shape[-2])):
        return kernels._replace(out_and_mlp=None)
    return kernels


def _pad_head_dim(x, width: int):
    """[T, H, D] -> [T, H, width], zeros after D: q.k and p.v are unchanged."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1])))


def _norm(cfg: ModelConfig, x, weight, feature_major: bool):
    """Feature-major, the statistics reduce over the major axis: XLA CPU transposed the
    activations to reduce over the minor one, twice the time (docs/performance_cpu.md,
    "Forward per bucket")."""
    if feature_major:
        return rms_norm(x, weight[:, None], cfg.rms_norm_eps, axis=0)
    return rms_norm(x, weight, cfg.rms_norm_eps)


def _layer(cfg: ModelConfig, shards: ShardPlan, kernels: KernelSet, batch: ForwardBatch,
           written: tuple, ropes: "_Ropes", matrices: tuple | None, stacked: dict,
           feature_major: bool, norms_in: "_NormsIn", observe: Observe | None, carry, xs):
    x, cache = carry
    lp, layer, window = xs
    cos, sin = ropes.of_layer(window)
    dot = _layer_dot(lp, matrices, layer, feature_major, observe)
    project = _layer_projections(kernels, lp, stacked, layer, dot, feature_major)
    with jax.named_scope("qkv"):
        h, h_norm = _input(cfg, x, lp["attn_norm"], norms_in.attention, feature_major)
        if isinstance(written, _BlockPages):
            q, k_pages, v_pages = _q_and_kv_pages(cfg, kernels, project, lp, h, h_norm, cos,
                                                  sin, cache, written)
        else:
            q, k, v = (_qkv_feature_major(cfg, lp, dot, h, cos, sin) if feature_major
                       else _qkv(cfg, kernels, project, lp, h, h_norm, cos, sin))
            q, k, v = (_pad_head_dim(y, cache.k.shape[-1]) for y in (q, k, v))
    if not isinstance(written, _BlockPages):
        with jax.named_scope("kv_write"):
            blocks = (page_blocks(new, written.page_tokens) for new in (k, v))
            k_pages, v_pages = kernels.write(cache.k, cache.v, layer, *blocks,
                                             written.page_ids)
    with jax.named_scope("attention"):
        windows = {"window": window} if cfg.windowed else {}
        attn = kernels.attend(q, k_pages, v_pages, layer, _layer_plan(batch.attention, window),
                              **windows)
        attn, attn_tiles = _attention_output(cfg, kernels, attn)
    if cfg.sandwich_norms:
        x = _sandwiched_sublayers(cfg, shards, kernels, lp, stacked, layer, project, x, attn,
                                  norms_in, feature_major)
        return (x, KVCache(k_pages, v_pages)), None
    mlp_norm = InputNorm(lp["mlp_norm"], cfg.rms_norm_eps)
    if kernels.out_and_mlp is not None:
        with jax.named_scope("out_and_mlp"):
            x = kernels.out_and_mlp(attn, stacked["wo"], x, *_mlp_weights(stacked),
                                    layer=layer, x_norm=mlp_norm, x_tile_heads=attn_tiles,
                                    **_mlp_int8(cfg, lp, ("wo",) + MLP_WEIGHTS))
        return (x, KVCache(k_pages, v_pages)), None
    with jax.named_scope("out_proj"):
        (x,) = project(attn.T if feature_major else attn, (("wo", "bo"),), "project_out",
                       shards, residual=x, x_tile_heads=attn_tiles)
    with jax.named_scope("mlp"):
        if kernels.mlp is not None:
            x = _mlp_kernel(cfg, kernels.mlp, lp, stacked, layer, x, mlp_norm, shards)
        else:
            x = _mlp_sublayer(cfg, kernels, lp, stacked, layer, project, x, norms_in,
                              feature_major, shards, residual=x)
    return (x, KVCache(k_pages, v_pages)), None


def _attention_output(cfg: ModelConfig, kernels: KernelSet, attn) -> tuple:
    """The attention's output [T, heads, the pool's D] as the output projection takes it,
    [T, heads x D], and the head dim of heads that stay a lane tile each (the projection
    kernel and the MLP kernel pack them in VMEM), or 0 where they are sliced out here (XLA's
    dots, Gemma's sandwiched sublayers, heads that do not divide a tile)."""
    tokens, _, d = attn.shape
    tiles = tiled_head_dim(cfg, d)
    if tiles and kernels.project is not None and not cfg.sandwich_norms:
        return attn.reshape(tokens, -1), tiles
    return attn[..., :cfg.head_dim].reshape(tokens, -1), 0


def tiled_head_dim(cfg: ModelConfig, pool_d: int) -> int:
    """The head dim of heads narrower than the pool's `pool_d` lanes that the projection
    kernels put a lane tile each (kernels.head_tiles); 0 where heads fill the pool's head dim
    or do not divide it."""
    return cfg.head_dim if pool_d != cfg.head_dim and pool_d % cfg.head_dim == 0 else 0


def _mlp_sublayer(cfg: ModelConfig, kernels: KernelSet, lp: dict, stacked: dict, layer,
                  project: Project, x, norms_in: "_NormsIn", feature_major: bool,
                  shards: ShardPlan, residual):
    """The MLP of x's norm (on the gate and up kernel where the backend has it), plus
    `residual` (None: the MLP alone)."""
    h, h_norm = _input(cfg, x, lp["mlp_norm"], norms_in.mlp, feature_major)
    gated_up = kernels.gated_up and functools.partial(  # down's Hadamard blocks in it too
        kernels.gated_up, w_gate=stacked["w_gate"], w_up=stacked["w_up"], layer=layer,
        x_norm=h_norm, scales=_scales(lp, ("w_gate", "w_up")), name="gate_up",
        activation=cfg.activation, hadamard=cfg.down_hadamard)
    spread = None if gated_up or not cfg.down_hadamard else functools.partial(
        hadamard_blocks, block=cfg.down_hadamard, axis=0 if feature_major else 1)
    return _mlp(ACTIVATIONS[cfg.activation], project, gated_up, h, shards, residual, spread)


def _sandwiched_sublayers(cfg: ModelConfig, shards: ShardPlan, kernels: KernelSet, lp: dict,
                          stacked: dict, layer, project: Project, x, attn, norms_in: "_NormsIn",
                          feature_major: bool):
    """Gemma 2's and 3's: the attention's and the MLP's outputs each RMS-normed before their
    residual adds (so no kernel adds a residual)."""
    with jax.named_scope("out_proj"):
        (out,) = project(attn.T if feature_major else attn, (("wo", "bo"),), "project_out",
                         shards)
        x = x + _norm(cfg, out, lp["attn_out_norm"], feature_major)
    with jax.named_scope("mlp"):
        out = _mlp_sublayer(cfg, kernels, lp, stacked, layer, project, x, norms_in,
                            feature_major, shards, residual=None)
        return x + _norm(cfg, out, lp["mlp_out_norm"], feature_major)


def plan_windows(cfg: ModelConfig) -> list[int]:
    """The window each layer's attention plan is built for: the model's widest where the layer
    has one (one plan serves them all, `_layer_plan`), else 0."""
    widest = max(cfg.layer_windows, default=0)
    return [widest if w else 0 for w in (cfg.layer_windows or (0,) * cfg.num_layers)]


def _layer_plan(md, window):
    """The metadata with the plan of this layer's kind: a windowed layer's skips the KV
    blocks its window hides from every row of a step (kernels.attention_plan)."""
    if md.window_plan is None:
        return md
    plan = jax.tree.map(lambda w, full: jnp.where(window > 0, w, full), md.window_plan, md.plan)
    return md._replace(plan=plan, window_plan=None)


class _Ropes(NamedTuple):
    """cos and sin of the layers without a window, and of those with one where their RoPE
    differs (Gemma 3's base and scaling)."""
    full: tuple
    local: tuple | None = None

    def of_layer(self, window):
        if self.local is None:
            return self.full
        return tuple(jnp.where(window > 0, a, b) for a, b in zip(self.local, self.full))


def _ropes(cfg: ModelConfig, positions, tables: Callable) -> _Ropes:
    full = tables(_scaled(positions, cfg.rope_factor), cfg.head_dim, cfg.rope_theta)
    if not cfg.local_rope:
        return _Ropes(full)
    return _Ropes(full, tables(positions, cfg.head_dim, cfg.local_rope_theta))


def _scaled(positions, factor: float):
    """Linear RoPE scaling: the positions divided by the factor (HF divides the frequencies)."""
    return positions if factor == 1.0 else positions.astype(jnp.float32) / factor


class _NormsIn(NamedTuple):
    """Whether the layer's input norms run in the kernels that read their output (q's and
    k's and v's projections; gate and up's): their weights whole in VMEM."""
    attention: bool = False
    mlp: bool = False


def _norms_in(cfg: ModelConfig, kernels: KernelSet, stacked: dict, tokens: int) -> _NormsIn:
    if kernels.project is None or kernels.gated_up is None:
        return _NormsIn()
    kv = stacked[KV_GROUP] if KV_GROUP in stacked else stacked["wk"]
    return norms_in_kernels(cfg, tokens, stacked["wq"].shape[-1], kv.shape[-1],
                            stacked["w_gate"].shape[-1], stacked["wq"].dtype.itemsize)


def norms_in_kernels(cfg: ModelConfig, tokens: int, q_width: int, kv_width: int,
                     inner_width: int, itemsize: int) -> _NormsIn:
    """Whether the projection kernels of this shard's widths take the input norms (their
    weights of `itemsize`)."""
    return _NormsIn(norm_fits(tokens, cfg.hidden_size, q_width, 1, itemsize)
                    and norm_fits(tokens, cfg.hidden_size, kv_width, 2, itemsize),
                    norm_fits(tokens, cfg.hidden_size, inner_width, 2, itemsize))


def _input(cfg: ModelConfig, x, weight, in_kernels: bool, feature_major: bool) -> tuple:
    """The input of a layer's projections and its norm: x and its RMSNorm for the kernels to
    apply, or x normed here (by XLA) and None."""
    if in_kernels:
        return x, InputNorm(weight, cfg.rms_norm_eps)
    return _norm(cfg, x, weight, feature_major), None


def hidden_states(params: dict, cfg: ModelConfig, cache: KVCache, batch: ForwardBatch,
                  kernels: KernelSet, shards: ShardPlan = ShardPlan(),
                  observe: Observe | None = None):
    """Final hidden states [T, H] (before the final norm) and the updated cache; under a
    shard_map when shards.tp > 1. `observe`: shown each XLA dot's input (not the kernels')."""
    x = embed_tokens(params["embed"], batch.tokens, shards)
    if cfg.embed_scale:  # HF casts the scale to the activations' dtype first
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
    matrices = params.get("layer_matrices")
    feature_major = matrices is not None and x.shape[0] <= FEATURE_MAJOR_MAX_TOKENS
    if feature_major or not rope_kernel_applies(cfg.head_dim, cfg.qk_norm):
        kernels = kernels._replace(rope=None)
    layer_params, stacked = params["layers"], {}
    if matrices is not None or not projection_kernel_applies(  # this shard's weights
            x.shape[0], (w.shape for k, w in layer_params.items() if k in PROJECTION_WEIGHTS)):
        kernels = kernels._replace(project=None, gated_up=None)
    if kernels.project is not None:  # the kernels read them at the layer, where they lie
        stacked = {k: w for k, w in layer_params.items() if k in PROJECTION_WEIGHTS}
        layer_params = {k: w for k, w in layer_params.items() if k not in stacked}
    kernels = _mlp_kernels(kernels, cfg, stacked, layer_params, x.shape[0], shards)
    tables = rope_lane_tables if kernels.rope else functools.partial(
        rope_tables, feature_major=feature_major)
    ropes = _ropes(cfg, batch.positions, tables)
    with jax.named_scope("written_pages"):
        written = _written(cfg, kernels, batch, cache)
    norms_in = _norms_in(cfg, kernels, stacked, x.shape[0])
    body = jax.named_scope("layer")(functools.partial(_layer, cfg, shards, kernels, batch,
                                                      written, ropes, matrices, stacked,
                                                      feature_major, norms_in, observe))
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    windows = jnp.asarray(cfg.layer_windows or (0,) * cfg.num_layers, jnp.int32)
    carry = (x.T if feature_major else x, cache)
    (x, cache), _ = jax.lax.scan(body, carry, (layer_params, layers, windows))
    return (x.T if feature_major else x), cache


class _TokenPages(NamedTuple):
    """The pages new tokens fill and the token of each of their rows (written_pages): the
    layers gather K and V into whole pages and write those."""
    page_ids: jax.Array
    page_tokens: jax.Array


class _BlockPages(NamedTuple):
    """The page each block of page_size tokens fills, a padding block's the pool's last page
    (a page-aligned batch): the k and v projection writes the pages itself."""
    ids: jax.Array


def block_page_ids(block_pages, sink: int):
    """The page each block of page_size tokens fills, a padding block's (-1) the pool's last,
    `sink` (kv_pool_shape)."""
    return jnp.where(block_pages >= 0, block_pages, sink)


def _written(cfg: ModelConfig, kernels: KernelSet, batch: ForwardBatch, cache: KVCache):
    """Where the layers' new K and V go: by blocks of tokens where the batch is page-aligned
    (in whole pages) and k's and v's projection kernel takes their heads whole (with k's norm
    and RoPE, and the pool's head dim theirs or a lane tile of heads that divide it), else by
    tokens."""
    d = cache.k.shape[-1]
    if (batch.block_pages is not None and kernels.project is not None
            and kernels.rope is not None and d % cfg.head_dim == 0
            and batch.tokens.shape[0] % cache.k.shape[3] == 0):
        return _BlockPages(block_page_ids(batch.block_pages, cache.k.shape[2] - 1))
    return _TokenPages(*written_pages(batch.attention, cache.k.shape[3], cache.k.shape[2]))


def model_kernels(cfg: ModelConfig, backend: str, max_q_len: int,
                  sizes: BlockSizes | None) -> KernelSet:
    """The backend's kernels, at `cfg`'s attention scale and soft-cap."""
    return select_kernels(backend, sm_scale=cfg.sm_scale, max_q_len=max_q_len, sizes=sizes,
                          softcap=cfg.attn_softcap)


def score_forward(params: dict, cache: KVCache, batch: ForwardBatch, *, cfg: ModelConfig,
                  max_q_len: int, backend: str = "reference", sizes: BlockSizes | None = None,
                  shards: ShardPlan = ShardPlan(), kernels: KernelSet | None = None):
    """Label logits [R, K] f32, logsumexp [R] f32 (zeros unless batch.with_logsumexp), and
    the updated cache. With block `sizes`, the attention plan is built here from the batch's
    metadata, on the devices. With shards.tp > 1, the body of a shard_map
    (model.sharding.shard_forward). `kernels`: instead of the backend's (a study's stand-ins:
    profiling.bench_ablation)."""
    if kernels is None:
        kernels = model_kernels(cfg, backend, max_q_len, sizes)
    if sizes is not None:
        with jax.named_scope("attention_plan"):
            batch = batch._replace(attention=plan_attention(
                batch.attention, sizes, cache.k.shape[3], max(plan_windows(cfg))))
    x, cache = hidden_states(params, cfg, cache, batch, kernels, shards)
    with jax.named_scope("label_gather"):
        label_logits, lse = _label_logits(kernels, x[batch.score_rows], params, cfg, batch,
                                          shards)
    return label_logits, lse, cache


def _label_logits(kernels: KernelSet, rows, params: dict, cfg: ModelConfig,
                  batch: ForwardBatch, shards: ShardPlan):
    """The logsumexp reads the whole head, so it is a branch taken at run time: one program
    serves a bucket either way, and one without it does not pay for it."""
    gather = functools.partial(gather_labels, kernels.gather, rows, params["final_norm"],
                               head_weight(params), batch.label_ids, shards,
                               eps=cfg.rms_norm_eps, num_rows=batch.num_rows,
                               num_labels=batch.num_labels, softcap=cfg.final_softcap)
    return jax.lax.cond(batch.with_logsumexp, lambda: gather(with_logsumexp=True),
                        lambda: (gather(with_logsumexp=False)[0],
                                 jnp.zeros(rows.shape[0], jnp.float32)))


def pool_head_dim(cfg: ModelConfig, backend: str) -> int:
    """The KV pool's head dim. The TPU kernels need row-major pages, in which a head dim below
    128 lanes takes a whole lane tile anyway; XLA would lay such a pool out another way and
    convert it around every kernel call. So the pool is lane-aligned, and the padding shows."""
    return lane_aligned(cfg.head_dim) if backend in TPU_BACKENDS else cfg.head_dim


def kv_pool_shape(cfg: ModelConfig, num_pages: int, page_size: int, backend: str,
                  kv_repeat: int = 1) -> tuple[int, ...]:
    """[layers, Hkv x kv_repeat, num_pages + 1, page_size, pool_head_dim]: `num_pages` to
    hand out, and a last one that takes the K/V of a page-aligned batch's padding blocks
    (the TPU's k and v projection copies every block of tokens into a page)."""
    return (cfg.num_layers, cfg.num_kv_heads * kv_repeat, num_pages + 1, page_size,
            pool_head_dim(cfg, backend))


def empty_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, backend: str,
                kv_repeat: int = 1) -> KVCache:
    shape = kv_pool_shape(cfg, num_pages, page_size, backend, kv_repeat)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
