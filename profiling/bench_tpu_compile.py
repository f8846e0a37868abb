"""The server's programs compiled for TPU v6e without a TPU: compile time, HBM, and the
compiler's own cost estimates, per model and token bucket.

python -m profiling.bench_tpu_compile [--models Qwen3-0.6B,...] [--tp-size 1]
    [--dtype bfloat16] [--buckets 16,128,512,2048,8192] [--max-prefill-tokens 8192]
    [--out tpu_compile.json]
Each program is what a server with these flags compiles for one replica on a deviceless v6e
topology (1 chip, or --tp-size chips of a 2x2 slice), the pool sized as the server sizes it
for a 32 GiB chip at the default --mem-fraction. Per program:
- compile_s: wall clock of the TPU compiler on this machine;
- hbm: memory_analysis() per chip, arguments (params, pool, batch), outputs, the outputs
  aliased to donated arguments (the pool, updated in place) and temp;
- xla: cost_analysis() of the compiled program: FLOPs and HBM bytes (for a Pallas kernel, its
  CostEstimate, at the padded sizes of the bucket: an upper bound), and `optimal_seconds`,
  XLA's own v6e time estimate. Estimates, not measurements: no TPU ran them. They add up both
  branches of the label gather (with and without the logsumexp), where a batch runs one.
- roofline: those FLOPs and bytes at v6e peak (918 TFLOP/s, 1.64 TB/s).
Uses libtpu: run it while no other process holds /tmp/libtpu_lockfile (a test run, say).
"""
import functools
import time

from absl import app, flags

from profiling.v6e.roofline import roofline
from profiling.timing import write_json
from profiling.v6e.compile import (
    SIZED_MODELS,
    STUDY_MODELS,
    V6E_HBM_BYTES,
    WINDOWED_MODELS,
    hbm_bytes,
    v6e_devices,
    xla_costs,
)
from runtime.cli_flags import parse_flags
from runtime.engine_config import EngineConfig
from runtime.forward_programs import server_programs
from runtime.pool_size import DeviceMemory, kv_pool_pages

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("models", list(SIZED_MODELS),
                      f"of {list(STUDY_MODELS)} or {list(WINDOWED_MODELS)}")
    flags.DEFINE_integer("tp_size", 1, "chips per replica: 1, or up to 4 of a v6e 2x2 slice")
    flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "weights and activations")
    flags.DEFINE_list("buckets", ["16", "128", "512", "2048", "8192"], "token buckets")
    flags.DEFINE_integer("max_prefill_tokens", 8192, "the server's batch budget")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def study(model: str, engine_cfg: EngineConfig, buckets: list[int]) -> dict:
    cfg = {**STUDY_MODELS, **WINDOWED_MODELS}[model]
    chips = v6e_devices(1 if engine_cfg.tp_size == 1 else 4)[:engine_cfg.tp_size]
    programs_with = functools.partial(server_programs, engine_cfg, cfg, chips)
    pages = kv_pool_pages(engine_cfg, programs_with, DeviceMemory(V6E_HBM_BYTES))
    programs = programs_with(pages)
    cases = []
    for tokens in buckets:
        shape = programs.buckets.shape(tokens)
        start = time.perf_counter()
        compiled = programs.get(shape)
        costs = xla_costs(compiled)
        cases.append({"bucket": shape.tokens, "compile_s": time.perf_counter() - start,
                      "hbm": hbm_bytes(compiled), "xla": costs,
                      "roofline": roofline(costs["flops"], costs["hbm_bytes"], None)})
    return {"model": model, "kv_pages": pages, "page_size": engine_cfg.page_size,
            "pool_bytes_per_chip": programs.pool_bytes, "cases": cases}


def run(models: list[str], engine_cfg: EngineConfig, buckets: list[int]) -> dict:
    return {"device": "TPU v6e (deviceless topology, libtpu)", "tp_size": engine_cfg.tp_size,
            "dtype": engine_cfg.dtype, "max_prefill_tokens": engine_cfg.max_prefill_tokens,
            "hbm_per_chip": V6E_HBM_BYTES, "mem_fraction": engine_cfg.mem_fraction,
            "estimates": "xla.* and roofline are compiler estimates; no TPU ran these programs",
            "models": [study(m, engine_cfg, buckets) for m in models]}


def main(argv) -> None:
    del argv
    engine_cfg = EngineConfig(dtype=FLAGS.dtype, tp_size=FLAGS.tp_size,
                              max_prefill_tokens=FLAGS.max_prefill_tokens)
    result = run(FLAGS.models, engine_cfg, [int(b) for b in FLAGS.buckets])
    print(f"{result['device']}, TP {result['tp_size']}, {result['dtype']}: {result['estimates']}")
    for m in result["models"]:
        print(f"{m['model']}: pool {m['pool_bytes_per_chip'] / 2**30:.2f} GiB per chip "
              f"({m['kv_pages']} pages of {m['page_size']})")
        for c in m["cases"]:
            hbm, xla = c["hbm"], c["xla"]
            optimal = f"{xla['optimal_s'] * 1e3:7.3f} ms" if xla["optimal_s"] else "    n/a   "
            print(f"  bucket {c['bucket']:5d} "
                  f"compile {c['compile_s']:5.1f} s  args {hbm['argument'] / 2**30:6.2f} GiB "
                  f"temp {hbm['temp'] / 2**20:7.1f} MiB  {xla['flops'] / 1e9:8.1f} GFLOP "
                  f"{xla['hbm_bytes'] / 1e9:6.2f} GB  XLA {optimal}  "
                  f"roofline {c['roofline']['v6e_roofline_s'] * 1e3:7.3f} ms")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
