"""Ragged paged attention over prefill and multi-item shapes: work after block skipping
(the kernel's own cost estimate at the plan's real steps), the v6e roofline, the v6e estimate
from the compiled kernel's schedule, and measured time on whatever backend runs it.

python -m profiling.bench_attention [--backend auto|xla|reference|pallas] [--shapes ...]
    [--q-block N --kv-block N] [--page N] [--[no]estimate] [--repeats 3] [--trace-dir D]
    [--out attention.json]
Heads default to Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128), bfloat16, one layer,
inputs from seed 0. Timing: with the Pallas kernel, its device time from a jax.profiler trace;
otherwise wall clock of the jitted call after block_until_ready, median of repeats, after a
warm-up call. `xla` is the planned loop the server runs off TPU; `reference` computes every
masked pair. The estimate (`profiling.v6e.schedule`, a model: no TPU ran it) compiles the
Pallas kernel for v6e at the same block sizes and counts the plan's real steps, the once-per-q-
block spans (the first step's init, the last step's store) weighted by how often they run.
With the 4k causal shape, the same estimate of JAX's own ragged_paged_attention
(jax.experimental.pallas.ops.tpu) at the same blocks, as a check and a bar.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ragged_paged_attention as jax_ragged_paged_attention,
)
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from kernels.attention_plan import (
    BlockSizes,
    default_block_sizes,
    host_plan,
    visited_kv_blocks,
)
from kernels.backends import KERNEL_BACKENDS, select_kernels
from kernels.ragged_paged_attention_kernel import ragged_paged_attention, whole_block_steps
from model.batch import ForwardBatch
from model.config import ModelConfig
from profiling.v6e.kernel_estimates import AttentionBlocks, attention_estimate
from profiling.v6e.roofline import roofline
from profiling.timing import TRACE_DEVICE_TIME, WALL_CLOCK, op_time, subdir, wall_time, write_json
from profiling.v6e.schedule import compile_schedules, estimate_seconds
from runtime.batch_builder import ScheduledSeq, build_batch
from runtime.buckets import ShapeBuckets, pages_needed
from runtime.cli_flags import parse_flags
from runtime.packing import causal_sequence, multi_item_sequence

SHAPES = {"mis_120q_10x18": (120, [18] * 10), "mis_120q_64x18": (120, [18] * 64),
          "mis_120q_256x18": (120, [18] * 256), "causal_4096": (4096, None)}
# A pool of 64 MiB per K and V: past what the compiler would place in VMEM, as a server's is.
_POOL_BYTES = 64 * 2**20

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("backend", "auto", ["auto", *KERNEL_BACKENDS],
                      "attention implementation (auto: pallas on TPU, xla elsewhere)")
    flags.DEFINE_list("shapes", list(SHAPES), "shapes to run")
    flags.DEFINE_integer("repeats", 3, "timed calls per shape")
    flags.DEFINE_integer("q_block", 0, "query tokens per block; 0: the TPU kind's table entry")
    flags.DEFINE_integer("kv_block", 0, "KV positions per block; 0: the TPU kind's table entry")
    flags.DEFINE_integer("page", 16, "KV page size in tokens")
    flags.DEFINE_bool("estimate", True, "add the v6e estimate from the compiled schedule")
    flags.DEFINE_string("trace_dir", None, "write a jax.profiler trace per shape here")
    flags.DEFINE_string("out", None, "write the results as JSON here")


@dataclasses.dataclass(frozen=True)
class Heads:
    q: int = 16
    kv: int = 8
    dim: int = 128
    page: int = 16


def make_batch(prefix: int, items: list[int] | None, heads: Heads, sizes: BlockSizes):
    seq = (causal_sequence(list(range(prefix))) if items is None
           else multi_item_sequence([1] * prefix, [[2] * n for n in items]))
    n, rows = len(seq.tokens), len(seq.score_rows)
    n_pages = pages_needed(n, heads.page)
    shape = ShapeBuckets(n, 1, rows, 1, n, heads.page, sizes).shape(n, rows, 1)
    batch = build_batch([ScheduledSeq(seq, list(range(n_pages)))], [[0]] * rows, shape,
                        heads.page)
    plan = host_plan(batch.attention, sizes, heads.page)
    return batch._replace(attention=batch.attention._replace(plan=plan)), shape.tokens, n_pages


def work(batch: ForwardBatch, heads: Heads, sizes: BlockSizes, itemsize: int):
    """(KV blocks visited, a dense causal kernel's count, the kernel's cost at the real steps)."""
    plan = batch.attention.plan
    visited = visited_kv_blocks(plan)
    pos = plan.token_pos
    block_ends = (pos[b:b + sizes.q_block].max() for b in range(0, len(pos), sizes.q_block))
    dense = int(sum(p // sizes.kv_block + 1 for p in block_ends if p >= 0))
    return visited, dense, _blocks(heads, sizes, itemsize).cost(plan)


def _blocks(heads: Heads, sizes: BlockSizes, itemsize: int) -> AttentionBlocks:
    return AttentionBlocks(sizes.q_block * heads.q // heads.kv, heads.kv, heads.dim, sizes,
                           itemsize)


def measure(batch, max_q_len, n_pages, heads: Heads, sizes, backend: str, repeats: int,
            trace_dir: str | None = None):
    cfg = ModelConfig("qwen3", 1, heads.q * heads.dim, 1, 1, heads.q, heads.kv, heads.dim,
                      1e6, 1e-6, 1 << 20)
    attend = select_kernels(backend, sm_scale=cfg.head_dim ** -0.5, max_q_len=max_q_len,
                            sizes=sizes).attend
    rng = np.random.default_rng(0)
    t = batch.tokens.shape[0]
    q = jnp.asarray(rng.standard_normal((t, heads.q, heads.dim)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, heads.kv, n_pages, heads.page, heads.dim)),
                     jnp.bfloat16)
    fn = jax.jit(functools.partial(attend, layer=0))
    md = jax.tree.map(jnp.asarray, batch.attention)
    if backend == "pallas":  # device time of the kernel itself, from a profiler trace
        return op_time(lambda *a: fn(*a, md=md), (q, kv, kv), "ragged_paged_attention", repeats,
                       trace_dir)
    return wall_time(lambda *a: fn(*a, md=md), (q, kv, kv), repeats, trace_dir)


def pool_pages(batch: ForwardBatch, heads: Heads) -> int:
    """The pool's pages: past what XLA would place in VMEM (docs/tpu_v6e.md), as a server's."""
    n_pages = int(np.asarray(batch.attention.page_indices).max()) + 1
    return max(n_pages, _POOL_BYTES // (heads.kv * heads.page * heads.dim * 2))


def kernel_case(shape: str, q_block: int, kv_block: int, heads: dict, tile: int = 0):
    """The Pallas kernel on `shape` as (fn, args) for `compile_schedules`."""
    heads, sizes = Heads(**heads), BlockSizes(q_block, kv_block, tile=tile)
    batch, max_q_len, _ = make_batch(*SHAPES[shape], heads, sizes)
    sds = jax.ShapeDtypeStruct
    pool = sds((1, heads.kv, pool_pages(batch, heads), heads.page, heads.dim), jnp.bfloat16)

    def attend(q, k, v, layer, md):
        return ragged_paged_attention(q, k, v, layer, md, sm_scale=heads.dim ** -0.5,
                                      max_q_len=max_q_len, sizes=sizes)
    q = sds((batch.tokens.shape[0], heads.q, heads.dim), jnp.bfloat16)
    return attend, (q, pool, pool, sds((), jnp.int32), batch.attention)


def schedule_estimates(shapes: list[str], heads: Heads, sizes: BlockSizes) -> dict[str, dict]:
    """Per shape: the kernel's bundles per step and the v6e estimate at the plan's real steps."""
    cases = [dict(shape=name, q_block=sizes.q_block, kv_block=sizes.kv_block,
                  heads=dataclasses.asdict(heads), tile=sizes.tile) for name in shapes]
    out = {}
    for name, result in zip(shapes, compile_schedules("profiling.bench_attention:kernel_case",
                                                      cases)):
        schedule = result["kernels"]["ragged_paged_attention"]
        batch = make_batch(*SHAPES[name], heads, sizes)[0]
        steps, _, cost = work(batch, heads, sizes, itemsize=2)
        plan = batch.attention.plan
        whole = whole_block_steps(plan, batch.attention, sizes, heads.page,
                                  pool_pages(batch, heads))
        out[name] = attention_estimate(schedule, plan, steps, cost.bytes_accessed,
                                       _blocks(heads, sizes, 2), whole)
    return out


def peer_case(tokens: int, q_block: int, kv_block: int, heads: dict):
    """JAX's own ragged_paged_attention on one causal sequence of `tokens`, as (fn, args) for
    `compile_schedules`. It reads the TPU generation while tracing: an abstract v6e mesh."""
    heads = Heads(**heads)
    sds = jax.ShapeDtypeStruct
    pages_per_seq = tokens // heads.page
    pages = max(pages_per_seq, _POOL_BYTES // (heads.page * heads.kv * heads.dim * 2))
    args = (sds((tokens, heads.q, heads.dim), jnp.bfloat16),
            sds((pages, heads.page, 2 * heads.kv, heads.dim), jnp.bfloat16),
            sds((1,), jnp.int32), sds((1, pages_per_seq), jnp.int32), sds((2,), jnp.int32),
            sds((1,), jnp.int32))
    v6e = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice(
        device_kind="TPU v6 lite", num_cores=1, platform="tpu"))

    def attend(*a):
        with jax.sharding.use_abstract_mesh(v6e):
            return jax_ragged_paged_attention(
                *a, sm_scale=heads.dim ** -0.5, num_kv_pages_per_block=kv_block // heads.page,
                num_queries_per_block=q_block)
    return attend, args


def peer_estimate(tokens: int, heads: Heads, sizes: BlockSizes) -> dict:
    """The v6e estimate of JAX's kernel on a causal prefill. It visits every KV block of the
    sequence for every q block (the mask does the causal work) in a loop whose bound is
    runtime data, once per grid step (q block)."""
    case = dict(tokens=tokens, q_block=sizes.q_block, kv_block=sizes.kv_block,
                heads=dataclasses.asdict(heads))
    (result,) = compile_schedules("profiling.bench_attention:peer_case", [case])
    schedule = result["kernels"]["ragged_paged_attention_kernel"]
    q_blocks, per_q_block = tokens // sizes.q_block, tokens // sizes.kv_block
    kv_loop = max(range(len(schedule.inner_loops)), key=lambda j: schedule.inner_loops[j][0])
    step_bytes = 2 * (per_q_block * heads.kv * sizes.kv_block + sizes.q_block * heads.q) * (
        heads.dim * 2)
    return {"kv_block_bundles": schedule.inner_loops[kv_loop][0],
            "kv_blocks_visited": q_blocks * per_q_block,
            "v6e_estimate_s": estimate_seconds(schedule, q_blocks, step_bytes=step_bytes,
                                               loop_trips={kv_loop: per_q_block})}


def run(shapes: list[str], backend: str, repeats: int, heads: Heads = Heads(),
        q_block: int = 0, kv_block: int = 0, trace_dir: str | None = None,
        estimate: bool = False) -> dict:
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "tpu" else "xla"
    device = jax.devices()[0].device_kind
    table = default_block_sizes("TPU v6 lite" if backend != "pallas" else device, heads.page)
    sizes = table.with_blocks(q_block or table.q_block, kv_block or table.kv_block)
    estimates = schedule_estimates(shapes, heads, sizes) if estimate else {}
    peer = (peer_estimate(SHAPES["causal_4096"][0], heads, sizes)
            if estimate and "causal_4096" in shapes else None)
    rows = {}
    for name in shapes:
        batch, max_q_len, n_pages = make_batch(*SHAPES[name], heads, sizes)
        visited, dense, cost = work(batch, heads, sizes, itemsize=2)
        seconds = measure(batch, max_q_len, n_pages, heads, sizes, backend, repeats,
                          subdir(trace_dir, name))
        rows[name] = {"kv_blocks_visited": visited, "kv_blocks_dense_causal": dense,
                      **roofline(cost.flops, cost.bytes_accessed, seconds)}
        if name in estimates:
            rows[name].update(estimates[name], estimate_fraction_of_roofline=(
                rows[name]["v6e_roofline_s"] / estimates[name]["v6e_estimate_s"]))
    timing = TRACE_DEVICE_TIME if backend == "pallas" else WALL_CLOCK
    return {"backend": backend, "device": device, "heads": dataclasses.asdict(heads),
            "block_sizes": dataclasses.asdict(sizes), "dtype": "bfloat16", "timing": timing,
            "estimate": "v6e, from the compiled schedule (profiling.v6e.schedule): a model"
            if estimate else None, "shapes": rows, "jax_kernel_causal_4096": peer}


def main(argv) -> None:
    del argv
    result = run(FLAGS.shapes, FLAGS.backend, FLAGS.repeats, Heads(page=FLAGS.page),
                 q_block=FLAGS.q_block, kv_block=FLAGS.kv_block, trace_dir=FLAGS.trace_dir,
                 estimate=FLAGS.estimate)
    print(f"backend={result['backend']} device={result['device']} blocks={result['block_sizes']} "
          f"timing: {result['timing']}")
    for name, r in result["shapes"].items():
        print(f"{name:18s} KV blocks {r['kv_blocks_visited']}/{r['kv_blocks_dense_causal']} "
              f"{r['flops'] / 1e9:.2f} GFLOP {r['hbm_bytes'] / 1e6:.2f} MB; v6e bound "
              f"{r['v6e_roofline_s'] * 1e6:.1f} us; measured {r['measured_s'] * 1e3:.1f} ms "
              f"({r['v6e_fraction']:.2e} of the v6e bound)" + (
                  f"; v6e estimate (model) {r['v6e_estimate_s'] * 1e6:.1f} us, "
                  f"{r['estimate_fraction_of_roofline']:.0%} of the bound"
                  if "v6e_estimate_s" in r else ""))
    if peer := result["jax_kernel_causal_4096"]:
        print(f"causal_4096, JAX's ragged_paged_attention at the same blocks: KV blocks "
              f"{peer['kv_blocks_visited']}, {peer['kv_block_bundles']} bundles each; v6e "
              f"estimate (model) {peer['v6e_estimate_s'] * 1e6:.1f} us")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
