"""The whole scoring forward, one per token bucket: measured time, the work it does, and the
v6e roofline of that work.

python -m profiling.bench_forward [--model-path P] [--dtype float32] [--max-prefill-tokens 2048]
    [--buckets 16,256,2048] [--kv-cache-tokens N] [--with-logsumexp] [--[no]estimate]
    [--repeats 3] [--reference-matmul 4096] [--trace-dir D] [--out fwd.json]
Each bucket's batch is filled with SGLang-shaped sequences (a 120-token query, 10 items of 18
tokens, 2 labels; the last sequence shorter) within the engine's sequence and row budgets, token
ids from seed 0. The prefix cache is not involved: every token is computed.
Work: per layer, the projections and MLP of the real tokens, the attention kernel's cost
estimate at the plan's real steps, and the K/V written; then the label gather's cost estimate.
HBM bytes count every weight once. Timing: wall clock of ModelRunner.run (host to scores) after
a warm-up call, median of repeats, on whatever backend JAX picks; each round runs every
bucket in turn.

Per bucket it also reports:
- where the time goes: op time per named scope from a traced run (profiling.trace_breakdown);
- host work: building the batch (plan, page tables) and what ModelRunner.run adds around the
  program's execution (dispatch, transfers, result decoding);
- the yardstick: the time the forward's dense matmuls (projections, MLP, the output head's
  rows) take at the matmul rate of one 4096^3 float32 matmul, timed just after each forward;
  the forward's multiple of it from the medians, the median of each round's multiple
  (a forward against the matmul timed just after it), and the best of rounds (the fastest
  forward against the fastest matmul: what a quiet spell of the machine gives);
- with --estimate: the same batch on one v6e chip in bfloat16, estimated from the compiled
  program's schedule (profiling.v6e.forward_estimate: a model, no TPU ran it), per level of the
  program (outside the layer loop, one layer), beside the roofline of its work.
"""
import dataclasses
import functools
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental import pallas as pl

from kernels.attention_plan import (
    host_plan,
    live_tile_share,
    real_q_blocks,
    visited_kv_blocks,
)
from kernels.label_gather_kernel import label_rows_cost, streamed_cost, streamed_row_block
from kernels.ragged_paged_attention_kernel import attention_cost
from kernels.ragged_paged_attention_xla import block_rows
from model.config import ModelConfig
from model.decoder import plan_windows
from profiling.v6e.forward_estimate import forward_estimate, v6e_batch
from profiling.v6e.roofline import roofline
from profiling.timing import WALL_CLOCK, interleaved_rounds, subdir, wall_time, write_json
from profiling.trace_breakdown import breakdown
from runtime.batch_builder import ScheduledSeq, build_batch
from runtime.buckets import ShapeBuckets, pages_needed
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.packing import multi_item_sequence

FLAGS = flags.FLAGS
QUERY, ITEMS, ITEM, LABELS = 120, 10, 18, 2
SCOPES = ("attention_plan", "written_pages", "qkv", "out_proj", "mlp", "attention", "kv_write",
          "label_gather")


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model to load; default: the embedded SmolLM2")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and activations")
    flags.DEFINE_integer("max_prefill_tokens", 2048, "the engine's batch budget (largest bucket)")
    flags.DEFINE_list("buckets", [], "token buckets to run; default: all of the engine's")
    flags.DEFINE_bool("with_logsumexp", True, "full-vocabulary probabilities (apply_softmax "
                      "false, SGLang's default); false: label logits only")
    flags.DEFINE_integer("kv_cache_tokens", 0, "KV pool size in tokens (0: the server's "
                         "default); a forward's time must not grow with it")
    flags.DEFINE_integer("repeats", 3, "timed forwards per bucket")
    flags.DEFINE_bool("estimate", True, "add the v6e estimate of the same batch in bfloat16, "
                      "from the compiled program's schedule (profiling.v6e.forward_estimate)")
    flags.DEFINE_string("trace_dir", None, "write a jax.profiler trace per bucket here")
    flags.DEFINE_integer("reference_matmul", 4096, "n of the yardstick's n^3 float32 matmul")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def fill(tokens: int, max_seqs: int, max_rows: int, vocab: int, rng, page: int = 1,
         query_len: int = QUERY, items: int = ITEMS) -> list:
    """Sequences of SGLang's shape (or `query_len` and `items` of ITEM tokens) totalling at
    most `tokens` tokens, each counted in whole `page`s (a page-aligned batch's:
    runtime.buckets)."""
    seqs, left, rows = [], tokens, 0
    while left > 1 and len(seqs) < max_seqs:
        length = min(left, query_len + items * ITEM)
        if pages_needed(length, page) * page > left:
            length = left // page * page
        if length < 2:
            break
        query = min(query_len, length - 1)
        rest = length - query
        n_items = min(-(-rest // ITEM), max_rows - rows)
        if n_items == 0:
            break
        sizes = [ITEM] * (n_items - 1) + [rest - ITEM * (n_items - 1)]
        ids = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
        seqs.append(multi_item_sequence(ids(query), [ids(n) for n in sizes]))
        left, rows = left - pages_needed(length, page) * page, rows + n_items
    return seqs


def filled_batch(engine_cfg: EngineConfig, vocab: int, rng, **shape) -> tuple[list, list]:
    """`fill`'s sequences (`shape`: its query_len and items) for one forward of `engine_cfg`'s
    budget as a TPU server batches them (each sequence's tokens in whole pages), on pages
    (`paged`), and their rows' labels (LABELS of them, the same for every row)."""
    seqs = fill(engine_cfg.max_prefill_tokens, engine_cfg.max_seqs, engine_cfg.max_rows, vocab,
                rng, engine_cfg.page_size, **shape)
    labels = [rng.integers(0, vocab, LABELS).tolist()] * sum(len(s.score_rows) for s in seqs)
    return paged(seqs, engine_cfg.page_size), labels


def paged(seqs: list, page_size: int) -> list[ScheduledSeq]:
    """`seqs` scheduled on consecutive pages of a pool, nothing cached."""
    entries, next_page = [], 0
    for seq in seqs:
        n = pages_needed(len(seq.tokens), page_size)
        entries.append(ScheduledSeq(seq, list(range(next_page, next_page + n))))
        next_page += n
    return entries


def schedule(buckets: ShapeBuckets, vocab: int, bucket: int, rng):
    """What the scheduler hands build_batch for a full `bucket`: entries, labels, shape. Each
    sequence is filled in whole pages, so that a TPU server, which pads every sequence to
    whole pages, fits the same sequences in the bucket too (the v6e estimate's batch)."""
    seqs = fill(bucket, buckets.max_seqs, buckets.max_rows, vocab, rng, buckets.page_size)
    entries = paged(seqs, buckets.page_size)
    rows = sum(len(s.score_rows) for s in seqs)
    labels = [rng.integers(0, vocab, LABELS).tolist()] * rows
    shape = buckets.shape_of((len(s.tokens) for s in seqs), rows, len(seqs))
    return entries, labels, shape


def study_engine(model_path: str | None, dtype: str, budget: int,
                 kv_cache_tokens: int = 0) -> Engine:
    """The engine the forward studies time: `budget` tokens a forward, as many sequences and
    rows as its buckets allow, no prefix cache, programs compiled when first run."""
    return Engine.from_path(model_path, EngineConfig(
        dtype=dtype, max_prefill_tokens=budget, max_seqs=min(64, budget),
        max_rows=min(256, budget), kv_cache_tokens=kv_cache_tokens, prefix_cache=False,
        warmup=False))


def bucket_batch(engine: Engine, bucket: int, with_lse: bool):
    """schedule()'s entries, labels and shape for a full `bucket`, and their batch."""
    runner = engine.runner
    entries, labels, shape = schedule(runner.buckets, engine.cfg.vocab_size, bucket,
                                      np.random.default_rng(0))
    return entries, labels, shape, build_batch(entries, labels, shape,
                                               runner.buckets.page_size, with_lse,
                                               runner.buckets.page_aligned)


def layer_flops(cfg: ModelConfig, tokens: int) -> int:
    """One layer's projections and MLP over `tokens` tokens."""
    h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2 * tokens * (h * (qd + 2 * kvd) + qd * h + 3 * h * cfg.intermediate_size)


def dense_flops(cfg: ModelConfig, tokens: int, rows: int, with_lse: bool) -> int:
    """The forward's matmuls with weights: projections and MLP of every token, and the output
    head of the scored rows (the whole vocabulary with the logsumexp, else the labels)."""
    head = cfg.vocab_size if with_lse else LABELS
    return cfg.num_layers * layer_flops(cfg, tokens) + 2 * rows * cfg.hidden_size * head


def reference_matmul(n: int = 4096):
    """The yardstick's matmul: one n^3 float32 matmul in JAX on the default device, and its
    FLOPs."""
    a = jnp.ones((n, n), jnp.float32)
    return (jax.jit(jnp.matmul), (a, a)), 2 * n ** 3


def attention_work(cfg: ModelConfig, plan, sizes, itemsize: int,
                   backend: str) -> pl.CostEstimate:
    """One layer's attention at the plan's real steps and the tiles they compute, its item
    steps included; the XLA loop's block steps take fewer rows than a q block where the batch
    has fewer tokens."""
    group = cfg.num_heads // cfg.num_kv_heads
    q_block = block_rows(len(plan.token_pos), sizes) if backend == "xla" else sizes.q_block
    cost = attention_cost(visited_kv_blocks(plan), real_q_blocks(plan), q_block * group,
                          cfg.num_kv_heads, cfg.head_dim, sizes.kv_block, itemsize,
                          live_tile_share(plan, sizes))
    if plan.items is None:
        return cost
    steps = int(plan.items.num_steps)
    items = attention_cost(steps, len(set(plan.items.block[:steps])),
                           sizes.item_q_block * group, cfg.num_kv_heads, cfg.head_dim,
                           sizes.item_kv_block, itemsize)
    return pl.CostEstimate(flops=cost.flops + items.flops,
                           transcendentals=cost.transcendentals + items.transcendentals,
                           bytes_accessed=cost.bytes_accessed + items.bytes_accessed)


def work(cfg: ModelConfig, params: dict, batch, tokens: int, rows: int, sizes, page_size: int,
         with_lse: bool, itemsize: int, backend: str):
    """(FLOPs, HBM bytes, int8 ops) of the forward's real work on `tokens` tokens and `rows`
    rows: an int8 model's projections and MLP are int8 ops, and its int8 weights a byte."""
    h, kvd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    dense = layer_flops(cfg, tokens)
    per_layer = plan_windows(cfg)
    by_window = {w: attention_work(cfg, host_plan(batch.attention, sizes, page_size, w), sizes,
                                   itemsize, backend) for w in set(per_layer)}
    attn = [by_window[w] for w in per_layer]
    gather = (streamed_cost(rows, LABELS, cfg.vocab_size, h, streamed_row_block(rows), itemsize)
              if with_lse else label_rows_cost(rows, LABELS, h, itemsize))
    layer_weights = sum(leaf.size * (1 if leaf.dtype == np.int8 else itemsize)
                        for leaf in jax.tree.leaves((params["layers"],
                                                     params.get("layer_matrices"))))
    kv_written = 2 * tokens * kvd * itemsize * cfg.num_layers
    projections = cfg.num_layers * dense
    flops = sum(a.flops for a in attn) + gather.flops
    hbm = (layer_weights + tokens * h * itemsize + sum(a.bytes_accessed for a in attn)
           + kv_written + gather.bytes_accessed)
    return (flops, hbm, projections) if cfg.quantization else (flops + projections, hbm, 0)


def _roofline(work_done: tuple, seconds: float) -> dict:
    flops, hbm, int8_ops = work_done
    return roofline(flops, hbm, seconds, int8_ops)


def host_seconds(engine: Engine, entries, labels, shape, repeats: int) -> float:
    """Median wall time of build_batch: the batch's arrays, padded, on the host (the program
    derives its attention plan and written pages from them on the devices)."""
    buckets = engine.runner.buckets
    return wall_time(build_batch, (entries, labels, shape, buckets.page_size, False,
                                   buckets.page_aligned), repeats)


def time_split(engine: Engine, batch, shape, repeats: int, trace_dir: str | None) -> dict:
    """Seconds per forward by scope, from `repeats` traced forwards of a compiled program."""
    runner = engine.runner
    program = runner.programs.get(shape)
    with tempfile.TemporaryDirectory() as tmp:
        traced = wall_time(lambda: runner.run(batch, shape), (), repeats,
                           trace_dir or tmp)
        split = breakdown(program, trace_dir or tmp, repeats, SCOPES)
    return {"traced_wall_s": traced, **split}


def v6e_estimate(cfg: ModelConfig, engine_cfg: EngineConfig, params: dict, entries, labels,
                 with_lse: bool) -> dict:
    """The same batch on a v6e chip in bfloat16 (a model: no TPU ran it): the estimate from the
    compiled program's schedule, its levels, and the roofline of its work at v6e's blocks.
    `params`: arrays or shapes, whose sizes count the weights read."""
    engine_cfg = dataclasses.replace(engine_cfg, dtype="bfloat16")
    built = v6e_batch(cfg, engine_cfg, entries, labels)
    _, batch, sizes = built
    estimate = forward_estimate(cfg, engine_cfg, entries, labels, with_lse, built)
    tokens = sum(e.new_tokens for e in entries)
    flops, hbm, int8_ops = work(cfg, params, batch, tokens, len(labels), sizes,
                                engine_cfg.page_size, with_lse, 2, "pallas")
    bound = roofline(flops, hbm, None, int8_ops)
    return {"seconds": estimate["v6e_estimate_s"], "roofline_s": bound["v6e_roofline_s"],
            "bf16_roofline_s": roofline(flops + int8_ops, hbm, None)["v6e_roofline_s"],
            "flops": bound["flops"], "int8_ops": bound["int8_ops"],
            "hbm_bytes": bound["hbm_bytes"],
            "fraction_of_roofline": bound["v6e_roofline_s"] / estimate["v6e_estimate_s"],
            "shape": estimate["shape"], "block_sizes": estimate["block_sizes"],
            "levels": estimate["levels"], "kernels": estimate["kernels"]}


def timed_rounds(runner, batches: list, matmul, repeats: int) -> list:
    """(forward seconds, matmul seconds) per round for each batch: every round runs each
    bucket's forward followed by the matmul, bucket after bucket, so that a slow spell of this
    shared machine (seconds long: docs/cpu_forward_log.md) falls on one round of several
    buckets rather than on every round of one."""
    calls = [call for _, _, shape, batch in batches for call in (
        (functools.partial(runner.run, batch, shape), ()), matmul)]
    rounds = interleaved_rounds(calls, repeats)
    return [(rounds[2 * i], rounds[2 * i + 1]) for i in range(len(batches))]


def run(engine: Engine, buckets: list[int], with_lse: bool, repeats: int,
        trace_dir: str | None = None, estimate: bool = False, matmul_n: int = 4096) -> dict:
    runner, rows, cfg = engine.runner, [], engine.cfg
    itemsize = np.dtype(engine.engine_cfg.dtype).itemsize
    matmul, matmul_flops = reference_matmul(matmul_n)
    batches = [bucket_batch(engine, bucket, with_lse) for bucket in buckets]
    timed = timed_rounds(runner, batches, matmul, repeats)
    for bucket, (entries, labels, shape, batch), rounds in zip(buckets, batches, timed):
        seconds, matmul_s = map(statistics.median, rounds)
        rate = matmul_flops / matmul_s
        split = time_split(engine, batch, shape, repeats, subdir(trace_dir, f"bucket_{bucket}"))
        tokens = sum(e.new_tokens for e in entries)
        dense = dense_flops(cfg, tokens, len(labels), with_lse)
        dense_s = dense / rate
        rows.append({"bucket": shape.tokens, "tokens": tokens, "seqs": len(entries),
                     "rows": len(labels), "tokens_per_s": tokens / seconds,
                     "matmul_flops_per_s": rate, "dense_matmul_s": dense_s,
                     "vs_dense_matmul": seconds / dense_s,
                     "vs_dense_matmul_by_round": statistics.median(
                         f * matmul_flops / (dense * m) for f, m in zip(*rounds)),
                     "vs_dense_matmul_best": min(rounds[0]) * matmul_flops / (
                         dense * min(rounds[1])),
                     "build_batch_s": host_seconds(engine, entries, labels, shape, repeats),
                     "split_s": split,
                     **_roofline(work(cfg, runner.params, batch, tokens, len(labels),
                                      runner.sizes, runner.buckets.page_size, with_lse,
                                      itemsize, runner.backend), seconds),
                     "v6e_estimate": v6e_estimate(cfg, engine.engine_cfg, runner.params,
                                                  entries, labels, with_lse)
                     if estimate else None})
    return {"model": cfg.family, "layers": cfg.num_layers,
            "dtype": engine.engine_cfg.dtype, "kernel_backend": runner.backend,
            "kv_pool_tokens": runner.num_pages * runner.buckets.page_size,
            "device": jax.devices()[0].device_kind, "with_logsumexp": with_lse,
            "timing": WALL_CLOCK + " of ModelRunner.run",
            "split": "op self-time per scope in a traced run, per forward "
                     "(profiling.trace_breakdown)", "buckets": rows}


def main(argv) -> None:
    del argv
    budget = FLAGS.max_prefill_tokens
    engine = study_engine(FLAGS.model_path, FLAGS.dtype, budget, FLAGS.kv_cache_tokens)
    buckets = [int(b) for b in FLAGS.buckets] or list(engine.runner.buckets.token_sizes())
    result = run(engine, buckets, FLAGS.with_logsumexp, FLAGS.repeats, FLAGS.trace_dir,
                 FLAGS.estimate, FLAGS.reference_matmul)
    engine.close()
    print(f"{result['model']} {result['dtype']} on {result['device']} "
          f"({result['kernel_backend']} kernels, KV pool of {result['kv_pool_tokens']} "
          f"tokens); timing: {result['timing']}")
    print("split: op ms per forward; matmul rate: the reference matmul's, timed in turn with "
          "the forward")
    for r in result["buckets"]:
        split = " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["split_s"].items())
        print(f"bucket {r['bucket']:5d}: {r['tokens']:5d} tokens {r['rows']:3d} rows "
              f"{r['measured_s'] * 1e3:9.1f} ms {r['tokens_per_s']:8.0f} tok/s "
              f"{r['vs_dense_matmul']:5.2f}x dense matmuls at "
              f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s ({r['vs_dense_matmul_by_round']:.2f}x "
              f"round by round, {r['vs_dense_matmul_best']:.2f}x best of rounds); build_batch "
              f"{r['build_batch_s'] * 1e3:.1f} ms; {r['flops'] / 1e9:8.1f} GFLOP; v6e bound "
              f"{r['v6e_roofline_s'] * 1e6:8.1f} us\n    split: {split}")
        if r["v6e_estimate"]:
            e = r["v6e_estimate"]
            levels = "; ".join(f"x{lv['trips']:.0f}: {lv['seconds_per_trip'] * 1e6:.1f} us "
                               f"(kernels {lv['kernels_s'] * 1e6:.1f} us, XLA ops "
                               f"{lv['xla_bundles']:.0f} bundles)" for lv in e["levels"])
            print(f"    v6e bf16 (estimate, a model): {e['seconds'] * 1e3:.3f} ms, bound "
                  f"{e['roofline_s'] * 1e3:.3f} ms ({e['fraction_of_roofline']:.0%}); {levels}")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
