"""Ragged paged attention over prefill and multi-item shapes: work after block skipping,
v6e roofline, and measured time on whatever backend runs it.

python -m profiling.bench_attention [--backend auto|reference|pallas] [--out results.json]
Heads default to Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128), bfloat16, one layer.
Timing: with the Pallas kernel, its device time from a jax.profiler trace; otherwise wall clock
of the jitted call after block_until_ready, median of repeats, after a warm-up. On CPU the
backend is the XLA reference path, which computes every masked pair.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kernels.attention_plan import BlockSizes, default_block_sizes, visited_kv_blocks
from model.batch import ForwardBatch
from model.config import ModelConfig
from model.decoder import ATTENTION_BACKENDS, kernel_impl
from profiling.timing import op_time, wall_time, write_json
from runtime.batch_builder import ScheduledSeq, build_batch
from runtime.buckets import ShapeBuckets, pages_needed
from runtime.cli_flags import parse_flags
from runtime.packing import causal_sequence, multi_item_sequence

V6E_FLOPS, V6E_HBM = 918e12, 1.64e12
SHAPES = {"mis_120q_10x18": (120, [18] * 10), "mis_120q_64x18": (120, [18] * 64),
          "mis_120q_256x18": (120, [18] * 256), "causal_4096": (4096, None)}

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("backend", "auto", ["auto", *ATTENTION_BACKENDS],
                      "attention implementation (auto: pallas on TPU, xla elsewhere)")
    flags.DEFINE_list("shapes", list(SHAPES), "shapes to run")
    flags.DEFINE_integer("repeats", 3, "timed calls per shape")
    flags.DEFINE_integer("q_block", 0, "query tokens per block; 0: the TPU kind's table entry")
    flags.DEFINE_integer("kv_block", 0, "KV positions per block; 0: the TPU kind's table entry")
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
                        heads.page, n_pages * heads.page, sizes)
    return batch, shape.tokens, n_pages


def work(batch: ForwardBatch, heads: Heads, sizes: BlockSizes, itemsize: int) -> dict:
    plan = batch.attention.plan
    visited = visited_kv_blocks(plan)
    last_pos = plan.row_pos.max(axis=1)
    dense = int(sum(p // sizes.kv_block + 1 for p in last_pos if p >= 0))
    flops = 4 * visited * heads.q * sizes.q_block * sizes.kv_block * heads.dim
    q_blocks = int((last_pos >= 0).sum())
    hbm = (2 * visited * heads.kv * sizes.kv_block * heads.dim
           + 2 * q_blocks * heads.q * sizes.q_block * heads.dim) * itemsize
    return {"kv_blocks_visited": visited, "kv_blocks_dense_causal": dense, "flops": flops,
            "hbm_bytes": hbm, "v6e_roofline_s": max(flops / V6E_FLOPS, hbm / V6E_HBM)}


def measure(batch, max_q_len, n_pages, heads: Heads, sizes, backend: str, repeats: int):
    cfg = ModelConfig("qwen3", 1, heads.q * heads.dim, 1, 1, heads.q, heads.kv, heads.dim,
                      1e6, 1e-6, 1 << 20)
    attend = kernel_impl(cfg, max_q_len, backend, sizes).attend
    rng = np.random.default_rng(0)
    t = batch.tokens.shape[0]
    q = jnp.asarray(rng.standard_normal((t, heads.q, heads.dim)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, heads.kv, n_pages, heads.page, heads.dim)),
                     jnp.bfloat16)
    fn = jax.jit(functools.partial(attend, layer=0))
    md = jax.tree.map(jnp.asarray, batch.attention)
    if backend == "pallas":  # device time of the kernel itself, from a profiler trace
        return op_time(lambda *a: fn(*a, md=md), (q, kv, kv), "ragged_paged_attention", repeats)
    return wall_time(lambda *a: fn(*a, md=md), (q, kv, kv), repeats)


def run(shapes: list[str], backend: str, repeats: int, heads: Heads = Heads(),
        q_block: int = 0, kv_block: int = 0) -> dict:
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "tpu" else "xla"
    device = jax.devices()[0].device_kind
    table = default_block_sizes("TPU v6 lite" if backend != "pallas" else device, heads.page)
    sizes = BlockSizes(q_block or table.q_block, kv_block or table.kv_block)
    rows = {}
    for name in shapes:
        batch, max_q_len, n_pages = make_batch(*SHAPES[name], heads, sizes)
        row = work(batch, heads, sizes, itemsize=2)
        row["measured_s"] = measure(batch, max_q_len, n_pages, heads, sizes, backend, repeats)
        rows[name] = row
    timing = ("profiler trace: device time of ragged_paged_attention, mean" if backend == "pallas"
              else "wall clock after block_until_ready, median")
    return {"backend": backend, "device": device, "heads": dataclasses.asdict(heads),
            "block_sizes": dataclasses.asdict(sizes), "dtype": "bfloat16", "timing": timing,
            "shapes": rows}


def main(argv) -> None:
    del argv
    result = run(FLAGS.shapes, FLAGS.backend, FLAGS.repeats, q_block=FLAGS.q_block,
                 kv_block=FLAGS.kv_block)
    print(f"backend={result['backend']} device={result['device']} blocks={result['block_sizes']}")
    print(f"{'shape':18s} {'visited':>8s} {'dense':>6s} {'GFLOP':>8s} {'HBM MB':>7s} "
          f"{'v6e us':>7s} {'measured ms':>11s}")
    for name, r in result["shapes"].items():
        print(f"{name:18s} {r['kv_blocks_visited']:8d} {r['kv_blocks_dense_causal']:6d} "
              f"{r['flops'] / 1e9:8.2f} {r['hbm_bytes'] / 1e6:7.2f} "
              f"{r['v6e_roofline_s'] * 1e6:7.1f} {r['measured_s'] * 1e3:11.1f}")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
