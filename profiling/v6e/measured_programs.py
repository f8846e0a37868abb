"""The programs a case file's measurements timed (profiling.v6e.measured_cases), to compile here
for one v6e chip, and how their Pallas kernels run: grid steps, which branches a step takes,
the bytes it copies.

Where tokamax is installed (the study's environment: Python 3.12, tokamax at the data's commit;
docs/tpu_v6e.md says how), a case compiles tokamax's own op with the measured config: the
program the chip ran. Without it, the closest JAX has: JAX's own splash attention for
tokamax's flash attention (its own copy of the kernel, without tokamax's later changes, the
experimental scheduler flag or base-2 exponentials), and the XLA programs' math in jax.numpy.
"""
import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from profiling.v6e.compile import v6e_devices
from profiling.v6e.measured_cases import shape_of
from profiling.v6e.schedule import KernelSchedule

FLASH = "tokamax.flash_attention"
XLA_ATTENTION = "tokamax.xla_chunked_attention"
XLA_CROSS_ENTROPY = "tokamax.chunked_xla_cross_entropy"
PROGRAMS = (FLASH, XLA_ATTENTION, XLA_CROSS_ENTROPY)
LANES = 128  # splash keeps its softmax statistics (and residuals) a lane row per query

_V6E = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice(
    device_kind="TPU v6 lite", num_cores=1, platform="tpu"))


def tokamax_installed() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def build(program: str, arguments: dict, config: dict, stand_in: bool = False):
    """(fn, args) of a case's program for `compile_schedules`: tokamax's op, or with
    `stand_in` the closest JAX program (the caller decides: `tokamax_installed`)."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown program {program!r}: one of {PROGRAMS}")
    if stand_in:
        return _STAND_INS[program](arguments, config)
    return _tokamax_op(program, arguments, config)


def _on_v6e(fn):
    """Trace `fn` as for a v6e chip: kernels and ops that ask the device (tokamax's
    `supported_on`, Pallas's `get_tpu_info`) see a v6e, not this machine's CPU."""
    @functools.wraps(fn)
    def traced(*args):
        with jax.default_device(v6e_devices(1)[0]), jax.sharding.use_abstract_mesh(_V6E):
            return fn(*args)
    return traced


def _tokamax_op(program: str, arguments: dict, config: dict):
    # tokamax's own argument-spec reader and benchmark wrapper: the function its autotuner
    # timed, with its arguments' shapes (no data).
    from tokamax._src import benchmarking
    from tokamax._src.ops import op as op_lib
    op = _tokamax_ops()[program](config)
    spec = op_lib._get_arg_spec_adapter(op).validate_python(arguments)
    bound = op_lib.BoundArguments(op, spec)
    fn, args = benchmarking.standardize_function(op, *bound.args, kwargs=bound.kwargs,
                                                 seed=None)
    return _on_v6e(fn), (args,)


def _tokamax_ops() -> dict:
    from tokamax._src.ops.attention import pallas_mosaic_tpu, xla_chunked
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

    def flash(config):
        layouts = {k: splash.QKVLayout(v) for k, v in config.items() if k.endswith("_layout")}
        return pallas_mosaic_tpu.PallasMosaicTpuFlashAttention(
            config=pallas_mosaic_tpu.Config(**{**config, **layouts}))

    return {FLASH: flash,
            XLA_ATTENTION: lambda config: xla_chunked.XlaChunkedDotProductAttention(),
            XLA_CROSS_ENTROPY: lambda config: chunked_xla.ChunkedXlaLinearSoftmaxCrossEntropyLoss(
                config=chunked_xla.Config(**config))}


def _array(spec: str | None):
    if spec is None:
        return None
    dtype, shape = shape_of(spec)
    return jax.ShapeDtypeStruct(shape, jnp.dtype({"bf16": "bfloat16", "f16": "float16",
                                                  "f32": "float32", "i32": "int32",
                                                  "bool": "bool"}[dtype]))


def _splash_stand_in(arguments: dict, config: dict):
    """JAX's splash attention with the case's blocks and layouts, wrapped as tokamax wraps its
    own: q scaled, [batch, seq, heads, dim] to [batch, heads, seq, dim] and back."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    q, k, v = (_array(arguments[n]) for n in "qkv")
    *batch, seq_q, heads, _ = q.shape
    seq_kv = k.shape[-3]
    if arguments["mask"]["is_causal"]:
        mask = splash.CausalMask((seq_q, seq_kv))
    else:
        mask = splash.FullMask((seq_q, seq_kv))
    blocks = splash.BlockSizes(
        block_q=config["block_q"], block_kv=config["block_kv"],
        block_kv_compute=config["block_kv_compute"], q_layout=splash.QKVLayout(
            config["q_layout"]), k_layout=splash.QKVLayout(config["k_layout"]),
        v_layout=splash.QKVLayout(config["v_layout"]))
    kernel = splash.make_splash_mha_single_device(
        splash.MultiHeadMask([mask] * heads), block_sizes=blocks,
        save_residuals=arguments["return_residuals"])

    def attend(q, k, v):
        q = q * arguments["logits_scale"]
        q, k, v = (x.reshape(-1, *x.shape[-3:]).swapaxes(1, 2) for x in (q, k, v))
        out = jax.vmap(kernel)(q, k, v)
        out = out[0] if arguments["return_residuals"] else out
        return out.swapaxes(1, 2).reshape(*batch, seq_q, heads, -1)
    return _on_v6e(attend), (q, k, v)


def _attention_math(arguments: dict, config: dict):
    """softmax(q k^T * scale + bias, masked) v in jax.numpy, float32 logits."""
    del config
    q, k, v, bias = (_array(arguments[n]) for n in ("q", "k", "v", "bias"))
    mask, causal = _array(arguments["mask"]["bool_mask"]), arguments["mask"]["is_causal"]
    args = [x for x in (q, k, v, bias, mask) if x is not None]

    def attend(q, k, v, *rest):
        rest = list(rest)
        b = rest.pop(0) if bias is not None else None
        m = rest.pop(0) if mask is not None else None
        groups = q.shape[-2] // k.shape[-2]
        k, v = (jnp.repeat(x, groups, axis=-2) for x in (k, v))
        logits = jnp.einsum("...qhd,...khd->...hqk", q, k,
                            preferred_element_type=jnp.float32) * arguments["logits_scale"]
        if b is not None:
            logits = logits + b.reshape(b.shape[:-4] + b.shape[-4:]).astype(jnp.float32)
        visible = jnp.ones(logits.shape[-2:], bool)
        if causal:
            visible = jnp.tril(visible)
        if m is not None:
            visible = visible & m.reshape(m.shape[:-4] + (m.shape[-2], 1, m.shape[-1])
                                          ).swapaxes(-3, -2)
        logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("...hqk,...khd->...qhd", weights, v)
    return attend, tuple(args)


def _cross_entropy_math(arguments: dict, config: dict):
    """The loss of softmax(x w) against the labels, in chunks of the config's rows and
    vocabulary columns, in jax.numpy."""
    x, labels, w = (_array(arguments[n]) for n in ("x", "labels", "w"))
    rows, columns = config["b_block_size"], config["v_block_size"]

    def loss(x, labels, w):
        vocab = w.shape[1]
        pad = -vocab % columns
        w_chunks = jnp.pad(w, ((0, 0), (0, pad))).reshape(w.shape[0], -1, columns)

        def row_block(args):
            xb, lb = args

            def column(carry, i):
                top, total, picked = carry
                logits = jnp.dot(xb, w_chunks[:, i].astype(xb.dtype),
                                 preferred_element_type=jnp.float32)
                ids = i * columns + jnp.arange(columns)
                logits = jnp.where(ids < vocab, logits, -jnp.inf)
                new_top = jnp.maximum(top, logits.max(axis=1))
                total = total * jnp.exp(top - new_top) + jnp.exp(
                    logits - new_top[:, None]).sum(axis=1)
                picked += jnp.where(ids[None] == lb[:, None], logits, 0).sum(axis=1)
                return (new_top, total, picked), None
            start = (jnp.full(xb.shape[0], -jnp.inf), jnp.zeros(xb.shape[0]),
                     jnp.zeros(xb.shape[0]))
            (top, total, picked), _ = jax.lax.scan(column, start,
                                                   jnp.arange(w_chunks.shape[1]))
            return top + jnp.log(total) - picked
        per_row = jax.lax.map(row_block, (x.reshape(-1, rows, x.shape[1]),
                                          labels.reshape(-1, rows))).reshape(-1)
        return per_row.mean() if arguments["reduction"] == "mean" else per_row.sum()
    return loss, (x, labels, w)


_STAND_INS = {FLASH: _splash_stand_in, XLA_ATTENTION: _attention_math,
              XLA_CROSS_ENTROPY: _cross_entropy_math}


@dataclasses.dataclass(frozen=True)
class KernelRuns:
    """How a kernel's grid runs on a case: its steps, and per step on average the share of
    steps that skip each of its schedule's spans, the HBM bytes copied, the first blocks
    copied before the first step (fill) and the last written after the last (drain)."""
    steps: int
    skipped: dict
    step_bytes: float
    fill_bytes: float
    drain_bytes: float


def splash_runs(arguments: dict, config: dict, schedule: KernelSchedule,
                stand_in: bool = False) -> KernelRuns:
    """Splash attention's grid on a case (square blocks; a causal mask by block, a full mask
    otherwise). tokamax's kernel lists only the (batch, head, q block, KV block) steps some
    query sees; JAX's (the stand-in) runs every block, one no query sees without its compute
    or copies. A step initializes on its row's first KV block, finalizes on its last, and
    computes its block, in tokamax's kernel in one of two branches: without a mask where every
    pair is visible, with it on the diagonal."""
    (_, q_shape), (dtype, k_shape), (_, v_shape) = (shape_of(arguments[n]) for n in "qkv")
    *batch, seq_q, heads, dim = q_shape
    seq_kv, dim_v = k_shape[-3], v_shape[-1]
    bq, bkv = config["block_q"], config["block_kv"]
    causal = arguments["mask"]["is_causal"]
    every = [(i, j) for i in range(seq_q // bq) for j in range(seq_kv // bkv)]
    blocks = [(i, j) for i, j in every if not causal or j * bkv <= (i + 1) * bq - 1]
    diagonal = sum(causal and (j + 1) * bkv - 1 > i * bq for i, j in blocks)
    grids = int(np.prod(batch)) * heads
    steps, rows = grids * len(every if stand_in else blocks), grids * seq_q // bq
    size = 2 if dtype in ("bf16", "f16") else 4
    q, k, v = bq * dim * size, bkv * dim * size, bkv * dim_v * size
    out = bq * dim_v * size + (2 * bq * LANES * 4 if arguments["return_residuals"] else 0)
    copies = _block_copies(blocks, grids)
    step_bytes = (copies["q"] * q + copies["kv"] * (k + v) + rows * out) / steps
    shares = _StepShares(rows / steps, grids * len(blocks) / steps, diagonal / len(blocks))
    return KernelRuns(steps, _splash_skipped(schedule, shares, causal and not stand_in),
                      step_bytes, q + k + v, out)


@dataclasses.dataclass(frozen=True)
class _StepShares:
    row_ends: float    # steps on a row's first (or last) KV block
    computing: float   # steps whose block some query sees
    diagonal: float    # of those, the blocks that need the mask


def _block_copies(blocks: list[tuple[int, int]], grids: int) -> dict:
    """How many times the pipeline copies a q block and a KV block in: when the block a step
    reads differs from the step before's (the grid runs the blocks of each (batch, head) in
    turn; a step without compute reads the block before it)."""
    order = [(g, i, j) for g in range(grids) for i, j in blocks]
    before = [None] + order[:-1]
    return {"q": sum(a is None or a[:2] != b[:2] for a, b in zip(before, order)),
            "kv": sum(a is None or (a[0], a[2]) != (b[0], b[2]) for a, b in zip(before, order))}


def _splash_skipped(schedule: KernelSchedule, shares: _StepShares, branched: bool) -> dict:
    """The share of steps skipping each branch of the step's main span (its largest), by how
    many it holds: four (init, unmasked, masked, finalize: tokamax's kernel on a causal mask),
    three (init, compute, finalize: JAX's), two (init, finalize: tokamax's on a full mask),
    one (compute: JAX's with one KV block a row, its init and finalize not branched); any
    other shape: none skipped."""
    top = [i for i, s in enumerate(schedule.spans) if s.depth == 0]
    if not top:
        return {}
    main = max(top, key=lambda i: schedule.spans[i].bundles)
    children, ends = schedule.children(main), 1 - shares.row_ends
    if branched and len(children) == 4:
        init, unmasked, masked, end = children
        return {init: ends, unmasked: shares.diagonal, masked: 1 - shares.diagonal, end: ends}
    if len(children) == 3:
        init, compute, end = children
        return {init: ends, compute: 1 - shares.computing, end: ends}
    if len(children) == 2:
        init, end = children
        return {init: ends, end: ends}
    if len(children) == 1:
        return {children[0]: 1 - shares.computing}
    return {}
