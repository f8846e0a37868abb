"""Where a sized model's forward spends its v6e time, op by op (an estimate from the compiled
schedule: a model, no TPU ran it).

python -m profiling.v6e.forward_breakdown [--models Qwen3-0.6B,Llama-3.2-1B]
    [--buckets 512,2048] [--query_tokens 120 --items 10] [--quantization int8]
    [--out breakdown.json]

Per model and bucket: the server's program for a batch of SGLang's shape (120-token queries,
10 items of 18 tokens, 2 labels, the bucket filled; profiling.bench_forward's `fill`; or
queries and items of other lengths) in bfloat16 on one v6e chip, its estimate against the
roofline of its work, and per level of the program (outside the layer loop, one layer; a
model with sliding windows: its attention a layer on average, full and windowed layers each
at their plan's steps) each kernel at its estimate and each XLA op of 500 bundles or more:
the named scope it came from, what it fuses, its bundles and time at the clock, and its own
MXU bound (its dots' FLOPs at 918 TFLOP/s) and HBM bound (its DMA bytes at 1.64 TB/s). An op
whose bundles are far above both bounds is issue-bound: the schedule, not the MXU or HBM,
sets its time. With --quantization int8 (W8A8), the int8 model's program, its roofline with
the projections' int8 ops at 1,836 TOPS beside the bf16 model's.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from model.config import int8_config
from model.params import param_dtypes, param_shapes
from profiling.bench_forward import ITEM, ITEMS, QUERY, filled_batch, v6e_estimate
from profiling.bench_host_work import bucket_config
from profiling.timing import write_json
from profiling.v6e.compile import STUDY_MODELS, WINDOWED_MODELS
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("models", ["Qwen3-0.6B"], f"of {sorted(STUDY_MODELS)} or "
                      f"{sorted(WINDOWED_MODELS)}")
    flags.DEFINE_list("buckets", ["512", "2048"], "forward sizes in tokens")
    flags.DEFINE_integer("query_tokens", QUERY, "each sequence's query (SGLang's: 120; a long "
                         "one shows what a sliding window skips)")
    flags.DEFINE_integer("items", ITEMS, f"each sequence's items, of {ITEM} tokens")
    flags.DEFINE_enum("quantization", "none", ["none", "int8"], "the model's (W8A8: "
                      "`--quantization int8`)")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def breakdown(model: str, bucket: int, query_len: int = QUERY, items: int = ITEMS,
              quantization: str = "") -> dict:
    cfg = {**STUDY_MODELS, **WINDOWED_MODELS}[model]
    cfg = int8_config(cfg) if quantization else cfg
    engine_cfg = bucket_config(bucket, "bfloat16")
    entries, labels = filled_batch(engine_cfg, cfg.vocab_size, np.random.default_rng(0),
                                   query_len=query_len, items=items)
    params = jax.tree.map(jax.ShapeDtypeStruct, param_shapes(cfg),
                          param_dtypes(cfg, jnp.bfloat16),
                          is_leaf=lambda x: isinstance(x, tuple))
    estimate = v6e_estimate(cfg, engine_cfg, params, entries, labels, with_lse=True)
    return {"model": model, "bucket": bucket, "query_tokens": query_len, "items": items,
            "config": dataclasses.asdict(cfg), **estimate}


def print_breakdown(r: dict) -> None:
    int8 = (f"; the projections' int8 ops at 1,836 TOPS, all at bf16's "
            f"{r['bf16_roofline_s'] * 1e3:.3f} ms" if r["int8_ops"] else "")
    print(f"{r['model']} at {r['bucket']} tokens: {r['seconds'] * 1e3:.3f} ms (estimate), "
          f"roofline {r['roofline_s'] * 1e3:.3f} ms ({r['fraction_of_roofline']:.0%}{int8})")
    kernels = "; ".join(f"{name} {k['v6e_estimate_s'] * 1e6:.1f} us"
                        for name, k in r["kernels"].items())
    print(f"  kernels a call: {kernels}")
    attention = r["kernels"]["attention"]
    if "windowed_layer" in attention:
        window = attention["windowed_layer"]
        print(f"  attention: a full layer {attention['plan_steps']} steps, "
              f"{attention['full_layer_s'] * 1e6:.1f} us; a windowed one "
              f"{window['plan_steps']} steps, {window['v6e_estimate_s'] * 1e6:.1f} us")
    for level in r["levels"]:
        print(f"  x{level['trips']:.0f}: {level['seconds_per_trip'] * 1e6:.1f} us a trip, "
              f"kernels {level['kernels_s'] * 1e6:.1f} us, XLA ops "
              f"{level['xla_bundles']:.0f} bundles")
        print("    bundles |     us | MXU us | HBM us | scope: fuses")
        for op in level["xla_ops"]:
            print(f"    {op['bundles']:7.0f} | {op['seconds'] * 1e6:6.1f} | "
                  f"{op['mxu_bound_s'] * 1e6:6.1f} | {op['hbm_bound_s'] * 1e6:6.1f} | "
                  f"{op['scope'] or op['name']}: {op['fuses']}")


def main(argv) -> None:
    del argv
    quantization = "" if FLAGS.quantization == "none" else FLAGS.quantization
    rows = [breakdown(model, int(bucket), FLAGS.query_tokens, FLAGS.items, quantization)
            for model in FLAGS.models for bucket in FLAGS.buckets]
    for r in rows:
        print_breakdown(r)
    write_json({"note": "v6e estimates from the compiled schedule; no TPU ran them",
                "runs": rows}, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
