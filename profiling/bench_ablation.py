"""What each of the forward's kernels costs: the server's forward with its attention or label
gather replaced by a stand-in, or its KV write done twice, compiled in one process and timed
in turn.

python -m profiling.bench_ablation [--model-path P] [--dtype float32] [--buckets 128,512,2048]
    [--rounds 9] [--max-prefill-tokens 2048] [--reference-matmul 4096] [--out ablation.json]
A trace's op times (bench_forward's split) are of a traced forward, which runs slower and not
evenly so; the time a part's removal saves is what it costs. Each variant is the server's
program for the bucket (ForwardPrograms.lower, the same compiler options) with parts of its
KernelSet swapped, keeping every other op of the program:
- without attention: q stands for the attention output;
- without the label gather: each scored row's first features stand for its label logits and
  logsumexp;
- the KV write twice: the same pages written again, so that its excess over the full
  forward is what one write costs (a stand-in that writes nothing lets XLA drop the K and V
  projections, and one that reads the new K/V costs more than the write: XLA CPU's
  reductions are slow);
- bare: without attention and without the label gather.
The batches are bench_forward's (SGLang's shape, with the logsumexp); the KV pool is donated
and passed from call to call. Per bucket: each variant's median seconds and its time over the
full forward's (the median of the rounds' ratios), its dots and scatters (a stand-in removes
its own only), and the full and the bare forward against the dense matmuls at the rate of a
4096^3 float32 matmul timed in turn, as in bench_forward.
"""
import functools
import re
import statistics

import jax
import jax.numpy as jnp
from absl import app, flags

from model.batch import pack
from model.decoder import model_kernels
from profiling.bench_forward import (
    bucket_batch,
    dense_flops,
    reference_matmul,
    study_engine,
)
from profiling.timing import interleaved_rounds, write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.model_runner import ModelRunner

FLAGS = flags.FLAGS
_OPS = ("dot", "scatter")  # counted in each variant's program


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "HF checkpoint dir or GGUF file; default: the "
                        "embedded SmolLM2")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and activations")
    flags.DEFINE_list("buckets", ["128", "512", "2048"], "token buckets to time")
    flags.DEFINE_integer("max_prefill_tokens", 2048, "the engine's token budget")
    flags.DEFINE_integer("rounds", 9, "timed rounds, each variant of each bucket once a round")
    flags.DEFINE_integer("reference_matmul", 4096, "n of the n^3 float32 matmul whose rate is "
                         "the yardstick")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def _attention_stand_in(q, k_pages, v_pages, layer, md):
    return q


def _gather_stand_in(hidden, norm_weight, head, label_ids, **_):
    rows = hidden.astype(jnp.float32)
    return rows[:, :label_ids.shape[1]], rows[:, 0]


def _twice(write):
    def write_twice(k_pages, v_pages, layer, *new):
        return write(*write(k_pages, v_pages, layer, *new), layer, *new)
    return write_twice


VARIANTS = {
    "full": lambda ks: ks,
    "without_attention": lambda ks: ks._replace(attend=_attention_stand_in),
    "without_label_gather": lambda ks: ks._replace(gather=_gather_stand_in),
    "kv_write_twice": lambda ks: ks._replace(write=_twice(ks.write)),
    "bare": lambda ks: ks._replace(attend=_attention_stand_in, gather=_gather_stand_in),
}


def op_counts(program) -> dict[str, int]:
    text = program.as_text()
    return {op: len(re.findall(rf"= \S+ {op}\(", text)) for op in _OPS}


def compile_variants(runner: ModelRunner, shape) -> dict:
    """Each variant's program for `shape`."""
    kernels = model_kernels(runner.cfg, runner.backend, shape.tokens, runner.sizes)
    programs = runner.programs
    return {name: programs.lower(shape, swap(kernels)).compile(programs.compiler_options)
            for name, swap in VARIANTS.items()}


class PoolChain:
    """Calls programs that each take a KV pool (donated) and give back the next one; the pool
    is a copy of the runner's, which stays as it was."""

    def __init__(self, runner: ModelRunner):
        self.params, self.cache = runner.params, jax.tree.map(jnp.copy, runner.cache)

    def call(self, program, batch):
        logits, lse, self.cache = program(self.params, self.cache, pack(batch))
        return logits, lse


def _bucket_row(cfg, shape, entries, labels, programs: dict, timed: dict, matmul: tuple) -> dict:
    """`timed`: each variant's seconds by round; `matmul`: the yardstick's (FLOPs, seconds)."""
    tokens = sum(e.new_tokens for e in entries)
    matmul_flops, matmul_s = matmul
    dense_s = dense_flops(cfg, tokens, len(labels), True) * matmul_s / matmul_flops
    seconds = {name: statistics.median(t) for name, t in timed.items()}
    return {"bucket": shape.tokens, "tokens": tokens, "rows": len(labels),
            "matmul_flops_per_s": matmul_flops / matmul_s, "dense_matmul_s": dense_s,
            "full_vs_dense": seconds["full"] / dense_s, "bare_vs_dense": seconds["bare"] / dense_s,
            "variants": {name: {"seconds": seconds[name],
                                "vs_full": statistics.median(
                                    v / f for v, f in zip(timed[name], timed["full"])),
                                "ops": op_counts(programs[name])} for name in VARIANTS}}


def run(engine: Engine, buckets: list[int], rounds: int, matmul_n: int = 4096) -> dict:
    runner = engine.runner
    if len(runner.devices) > 1:
        raise ValueError("the ablation study runs on one device")
    matmul, matmul_flops = reference_matmul(matmul_n)
    chain, calls, cases = PoolChain(runner), [], []
    for bucket in buckets:
        entries, labels, shape, batch = bucket_batch(engine, bucket, True)
        programs = compile_variants(runner, shape)
        calls += [(functools.partial(chain.call, p, batch), ()) for p in programs.values()]
        calls.append(matmul)
        cases.append((shape, entries, labels, programs))
    times, n = interleaved_rounds(calls, rounds), len(VARIANTS) + 1
    rows = [_bucket_row(engine.cfg, *case, dict(zip(VARIANTS, times[i * n:(i + 1) * n - 1])),
                        (matmul_flops, statistics.median(times[(i + 1) * n - 1])))
            for i, case in enumerate(cases)]
    return {"model": engine.cfg.family, "dtype": engine.engine_cfg.dtype,
            "kernel_backend": runner.backend, "device": jax.devices()[0].device_kind,
            "rounds": rounds, "buckets": rows}


def main(argv) -> None:
    del argv
    engine = study_engine(FLAGS.model_path, FLAGS.dtype, FLAGS.max_prefill_tokens)
    result = run(engine, [int(b) for b in FLAGS.buckets], FLAGS.rounds, FLAGS.reference_matmul)
    engine.close()
    print(f"{result['model']} {result['dtype']} on {result['device']} "
          f"({result['kernel_backend']} kernels), {result['rounds']} rounds: median ms, and "
          f"the time over the full forward's (median of the rounds' ratios)")
    for r in result["buckets"]:
        variants = ", ".join(f"{name} {v['seconds'] * 1e3:.1f} ms ({v['vs_full']:.3f})"
                             for name, v in r["variants"].items())
        print(f"bucket {r['bucket']:5d}: {variants}; full {r['full_vs_dense']:.2f}x, bare "
              f"{r['bare_vs_dense']:.2f}x dense matmuls at "
              f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
