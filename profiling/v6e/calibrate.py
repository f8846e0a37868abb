"""Checking the static v6e cost model (`profiling.v6e.schedule`) on kernels whose answer is
known: the clock that Pallas matmuls imply against XLA's own v6e estimate (`optimal_seconds`)
for the same dot, and the DMA side from a copy kernel against the HBM bandwidth. This was the
model's first calibration; its constants are now fitted on real v6e measurements
(`profiling.v6e.against_measured`, `profiling.v6e.chip`), and this checks them.

python -m profiling.v6e.calibrate [--out calibration.json]
Per matmul shape: the kernel's grid steps and bundles per step, XLA's estimate for `jnp.dot`
on the same operands, and the clock that makes the two agree; the clock is their median and
the calibration error the largest relative miss of the estimate at that clock. Per XLA dot of
a Qwen3-0.6B layer's shapes: its bundles read as the forward's estimate reads them, against
XLA's own estimate and the MXU bound. Per copy
shape: the estimate at that clock against its bytes at the model's HBM rate. Compiles only:
no TPU runs.
"""
import dataclasses
import statistics

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from profiling.timing import write_json
from profiling.v6e.program_schedule import level_from_json
from profiling.v6e.roofline import V6E_FLOPS
from profiling.v6e.chip import V6E
from profiling.v6e.schedule import compile_schedules, estimate_seconds
from runtime.cli_flags import parse_flags

# (m, k, n) and (bm, bk, bn), bfloat16: MXU-bound blocks, from one grid step to hundreds.
MATMULS = (((1024, 2048, 1024), (256, 512, 256)), ((2048, 2048, 2048), (512, 512, 512)),
           ((4096, 4096, 4096), (512, 1024, 512)), ((8192, 2048, 4096), (1024, 512, 1024)),
           ((2048, 8192, 2048), (512, 2048, 512)))
# The projections and MLP of a Qwen3-0.6B layer at 2048 tokens (m, k, n), and a large square.
MODEL_DOTS = ((2048, 1024, 2048), (2048, 1024, 1024), (2048, 2048, 1024), (2048, 1024, 3072),
              (2048, 3072, 1024), (2048, 1024, 6144), (4096, 4096, 4096))
# (rows, cols) float32, and rows per block.
COPIES = (((8192, 1024), 512), ((32768, 1024), 1024), ((16384, 4096), 256))

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("out", None, "write the results as JSON here")


def _matmul_kernel(a_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def pallas_matmul(m: int, k: int, n: int, bm: int, bk: int, bn: int):
    def matmul(a, b):
        return pl.pallas_call(
            _matmul_kernel, grid=(m // bm, n // bn, k // bk), name="calibration_matmul",
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                      pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)])(a, b)
    return matmul, _operands(m, k, n)


def xla_dot(m: int, k: int, n: int):
    return jnp.dot, _operands(m, k, n)


def xla_dot_loop(m: int, k: int, n: int, layers: int):
    """A layer loop of dots, as a model's: `h @ w[i]` for each of `layers` stacked weights."""
    def loop(h, w):
        return jax.lax.scan(lambda x, wi: ((x @ wi).astype(x.dtype), None), h, w)[0]
    return loop, (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                  jax.ShapeDtypeStruct((layers, k, n), jnp.bfloat16))


def _operands(m, k, n):
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def pallas_copy(rows: int, cols: int, block_rows: int):
    def copy(x):
        spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
        return pl.pallas_call(_copy_kernel, grid=(rows // block_rows,), name="calibration_copy",
                              in_specs=[spec], out_specs=spec,
                              out_shape=jax.ShapeDtypeStruct((rows, cols), x.dtype))(x)
    return copy, (jax.ShapeDtypeStruct((rows, cols), jnp.float32),)


def matmul_rows(shapes=MATMULS) -> list[dict]:
    cases = [dict(m=m, k=k, n=n, bm=bm, bk=bk, bn=bn) for (m, k, n), (bm, bk, bn) in shapes]
    kernels = compile_schedules("profiling.v6e.calibrate:pallas_matmul", cases)
    dots = compile_schedules("profiling.v6e.calibrate:xla_dot",
                             [dict(m=c["m"], k=c["k"], n=c["n"]) for c in cases])
    rows = []
    for case, kernel, dot in zip(cases, kernels, dots):
        s = kernel["kernels"]["calibration_matmul"]
        steps = (case["m"] // case["bm"]) * (case["n"] // case["bn"]) * (case["k"] // case["bk"])
        bundles = steps * s.step + s.prologue + s.epilogue
        rows.append({**case, "steps": steps, "step_bundles": s.step,
                     "step_units": s.step_units, "step_hbm_dma_bytes": s.step_hbm_dma_bytes,
                     "bundles": bundles, "xla_flops": dot["xla"]["flops"],
                     "xla_optimal_s": dot["xla"]["optimal_s"],
                     "implied_clock_hz": bundles / dot["xla"]["optimal_s"]})
    return rows


def xla_dot_rows(clock_hz: float, shapes=MODEL_DOTS) -> list[dict]:
    """XLA's own dots, read as the forward's estimate reads XLA ops (the program's listings,
    profiling.v6e.program_schedule), against XLA's `optimal_seconds` for them and the MXU's
    bf16 peak: whether the estimate misprices XLA's ops, or they run below the MXU's rate."""
    rows = []
    cases = [dict(m=m, k=k, n=n) for m, k, n in shapes]
    for case, result in zip(cases, compile_schedules("profiling.v6e.calibrate:xla_dot", cases,
                                                     program=True)):
        levels = [level_from_json(x) for x in result["levels"]]
        bundles = sum(level.trips * level.xla_cost({}).bundles for level in levels)
        mxu_s = 2 * case["m"] * case["k"] * case["n"] / V6E_FLOPS
        rows.append({**case, "bundles": bundles, "estimate_s": bundles / clock_hz,
                     "xla_optimal_s": result["xla"]["optimal_s"], "mxu_bound_s": mxu_s,
                     "estimate_over_mxu": bundles / clock_hz / mxu_s})
    return rows


def copy_rows(clock_hz: float) -> list[dict]:
    cases = [dict(rows=r, cols=c, block_rows=b) for (r, c), b in COPIES]
    rows = []
    for case, result in zip(cases, compile_schedules("profiling.v6e.calibrate:pallas_copy",
                                                     cases)):
        s = result["kernels"]["calibration_copy"]
        steps = case["rows"] // case["block_rows"]
        hbm_bound = 2 * case["rows"] * case["cols"] * 4 / V6E.hbm_bytes_per_s
        estimate = estimate_seconds(s, steps, dataclasses.replace(V6E, clock_hz=clock_hz))
        rows.append({**case, "steps": steps, "step_bundles": s.step,
                     "step_hbm_dma_bytes": s.step_hbm_dma_bytes, "estimate_s": estimate,
                     "hbm_bound_s": hbm_bound, "estimate_over_bound": estimate / hbm_bound})
    return rows


def calibrate() -> dict:
    matmuls = matmul_rows()
    clock = statistics.median(r["implied_clock_hz"] for r in matmuls)
    for r in matmuls:
        r["estimate_s"] = r["bundles"] / clock
        r["miss"] = r["estimate_s"] / r["xla_optimal_s"] - 1
    return {"clock_hz": clock, "clock_error": max(abs(r["miss"]) for r in matmuls),
            "matmuls": matmuls, "xla_dots": xla_dot_rows(clock), "copies": copy_rows(clock),
            "hbm_bytes_per_s": V6E.hbm_bytes_per_s,
            "note": "estimates from the compiled schedule; no TPU ran them"}


def main(argv) -> None:
    del argv
    result = calibrate()
    print(f"clock {result['clock_hz'] / 1e9:.3f} GHz (median implied by {len(result['matmuls'])} "
          f"matmuls), largest miss {result['clock_error']:.1%}")
    for r in result["matmuls"]:
        print(f"matmul {r['m']}x{r['k']}x{r['n']} blocks {r['bm']}/{r['bk']}/{r['bn']}: "
              f"{r['steps']} steps x {r['step_bundles']} bundles; XLA "
              f"{r['xla_optimal_s'] * 1e6:.1f} us, estimate {r['estimate_s'] * 1e6:.1f} us "
              f"({r['miss']:+.1%}); implied clock {r['implied_clock_hz'] / 1e9:.3f} GHz; "
              f"units {r['step_units']}")
    for r in result["xla_dots"]:
        print(f"XLA dot {r['m']}x{r['k']}x{r['n']}: {r['bundles']:.0f} bundles, estimate "
              f"{r['estimate_s'] * 1e6:.1f} us; XLA's own {r['xla_optimal_s'] * 1e6:.1f} us; MXU "
              f"bound {r['mxu_bound_s'] * 1e6:.1f} us ({r['estimate_over_mxu']:.2f}x)")
    for r in result["copies"]:
        print(f"copy {r['rows']}x{r['cols']} f32 by {r['block_rows']} rows: {r['steps']} steps "
              f"x {r['step_bundles']} bundles, {r['step_hbm_dma_bytes']} DMA bytes; estimate "
              f"{r['estimate_s'] * 1e6:.1f} us vs HBM bound {r['hbm_bound_s'] * 1e6:.1f} us "
              f"({r['estimate_over_bound']:.2f}x)")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
