"""Final norm + label gather over vocab sizes and modes: the kernels' own cost estimates, the
v6e roofline, and measured time, against a full-logits baseline.

python -m profiling.bench_label_gather [--vocabs 49152,151936,262144] [--rows 1,8,64,256]
    [--hidden 1024] [--labels 2] [--[no]estimate] [--repeats 3] [--trace-dir D]
    [--out label_gather.json]
Modes: labels only (apply_softmax=true: only the label rows of the head are read) and streamed
logsumexp (apply_softmax=false: the head streamed once per block of rows, no logits written).
Baseline: what a server that builds logits does: read the head, write [R, V] float32 logits,
read them back for the log-softmax and the gather. bfloat16, inputs from seed 0; the rows share
their labels, as a request's items do (one label run).
Timing: on TPU the Pallas kernels' device time in a profiler trace (the baseline by wall
clock); elsewhere wall clock after block_until_ready of the path the server runs there (the
row-blocked XLA loop), median of repeats after a warm-up call. The v6e estimate of each
kernel (`profiling.v6e.schedule`, a model: no TPU ran it) compiles it for v6e and counts its
grid steps, with its loops over labels run once per label.
"""
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kernels.label_gather import final_norm_label_gather_xla
from kernels.label_gather_kernel import (
    final_norm_label_gather,
    label_row_block,
    label_rows_cost,
    streamed_cost,
    streamed_row_block,
)
from kernels.tpu_tiles import lane_aligned
from profiling.v6e.kernel_estimates import GATHER_KERNELS, label_gather_estimate
from profiling.v6e.roofline import roofline
from profiling.timing import TRACE_DEVICE_TIME, WALL_CLOCK, op_time, subdir, wall_time, write_json
from profiling.v6e.schedule import compile_schedules
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS
MODES = ("labels_only", "streamed_logsumexp", "full_logits_baseline")


def define_flags() -> None:
    flags.DEFINE_list("vocabs", ["49152", "151936", "262144"], "vocabulary sizes")
    flags.DEFINE_list("rows", ["1", "8", "64", "256"], "scored rows per call")
    flags.DEFINE_integer("hidden", 1024, "hidden size")
    flags.DEFINE_integer("labels", 2, "label ids per row")
    flags.DEFINE_bool("estimate", True, "add the v6e estimate from the compiled schedules")
    flags.DEFINE_integer("repeats", 3, "timed calls per case")
    flags.DEFINE_string("trace_dir", None, "write a jax.profiler trace per case here")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def work(rows: int, vocab: int, hidden: int, labels: int, itemsize: int = 2) -> dict:
    """(FLOPs, HBM bytes) per mode: the kernels' cost estimates, and the baseline's."""
    lab = label_rows_cost(rows, labels, hidden, itemsize)
    st = streamed_cost(rows, labels, vocab, hidden, streamed_row_block(rows), itemsize)
    base_bytes = rows * hidden * itemsize + vocab * hidden * itemsize + 2 * rows * vocab * 4
    return {"labels_only": (lab.flops, lab.bytes_accessed),
            "streamed_logsumexp": (st.flops, st.bytes_accessed),
            "full_logits_baseline": (2 * rows * vocab * hidden, base_bytes)}


def full_logits_baseline(hidden, norm, head, labels, eps):
    x = hidden * jax.lax.rsqrt(jnp.mean(hidden.astype(jnp.float32) ** 2, -1, keepdims=True) + eps)
    logits = jnp.dot((x * norm).astype(head.dtype), head.T, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels, axis=1)


def _paths(rows: int) -> dict:
    """The code each mode runs on this backend."""
    if jax.default_backend() == "tpu":
        gather = final_norm_label_gather
    else:
        gather = lambda *a, **kw: final_norm_label_gather_xla(*a, num_rows=rows, **kw)  # noqa: E731
    return {"labels_only": lambda *a: gather(*a, eps=1e-6, with_logsumexp=False)[0],
            "streamed_logsumexp": lambda *a: gather(*a, eps=1e-6, with_logsumexp=True),
            "full_logits_baseline": lambda *a: full_logits_baseline(*a, eps=1e-6)}


def measure(rows: int, vocab: int, hidden: int, labels: int, repeats: int,
            trace_dir: str | None) -> dict:
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((rows, hidden)), jnp.bfloat16),
            jnp.ones(hidden, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.bfloat16),
            jnp.asarray(np.tile(rng.integers(0, vocab, labels), (rows, 1)), jnp.int32))
    times = {}
    for mode, fn in _paths(rows).items():
        out = subdir(trace_dir, mode)
        if jax.default_backend() == "tpu" and mode in GATHER_KERNELS:
            times[mode] = op_time(jax.jit(fn), args, GATHER_KERNELS[mode], repeats, out)
        else:
            times[mode] = wall_time(jax.jit(fn), args, repeats, out)
    return times


def kernel_case(mode: str, rows: int, vocab: int, hidden: int, labels: int):
    """The mode's kernels as (fn, args) for `compile_schedules`. Labels only: two row blocks,
    since a grid of one step compiles without a grid loop (the schedule's step would be a loop
    inside it); where there are more blocks they are of whole lane tiles, so below 128 rows a
    step is estimated at 128 (an upper bound)."""
    sds = jax.ShapeDtypeStruct
    block = lane_aligned(label_row_block(rows))
    rows = 2 * block if mode == "labels_only" else rows
    args = (sds((rows, hidden), jnp.bfloat16), sds((hidden,), jnp.bfloat16),
            sds((vocab, hidden), jnp.bfloat16), sds((rows, labels), jnp.int32))
    with_lse = mode == "streamed_logsumexp"

    def gather(*a):
        return final_norm_label_gather(*a, eps=1e-6, with_logsumexp=with_lse,
                                       max_label_rows=block)
    return gather, args


def schedule_estimates(cases: list[tuple[int, int]], hidden: int, labels: int) -> dict:
    """(vocab, rows) -> mode -> the kernel's v6e estimate from its compiled schedule."""
    requests = [dict(mode=mode, rows=rows, vocab=vocab, hidden=hidden, labels=labels)
                for vocab, rows in cases for mode in GATHER_KERNELS]
    out = {}
    for req, result in zip(requests, compile_schedules("profiling.bench_label_gather:kernel_case",
                                                       requests)):
        schedule = result["kernels"][GATHER_KERNELS[req["mode"]]]
        kernel_bytes = work(req["rows"], req["vocab"], hidden, labels)[req["mode"]][1]
        out.setdefault((req["vocab"], req["rows"]), {})[req["mode"]] = label_gather_estimate(
            schedule, req["mode"], req["rows"], req["vocab"], hidden, labels, kernel_bytes)
    return out


def run(vocabs: list[int], rows_list: list[int], hidden: int, labels: int, repeats: int,
        trace_dir: str | None = None, estimate: bool = False) -> dict:
    estimates = (schedule_estimates([(v, r) for v in vocabs for r in rows_list], hidden, labels)
                 if estimate else {})
    cases = []
    for vocab in vocabs:
        for rows in rows_list:
            seconds = measure(rows, vocab, hidden, labels, repeats,
                              subdir(trace_dir, f"V{vocab}_R{rows}"))
            modes = {mode: roofline(*cost, seconds[mode])
                     for mode, cost in work(rows, vocab, hidden, labels).items()}
            for mode, e in estimates.get((vocab, rows), {}).items():
                modes[mode].update(e, estimate_over_roofline=(
                    e["v6e_estimate_s"] / modes[mode]["v6e_roofline_s"]))
            cases.append({"vocab": vocab, "rows": rows, "modes": modes})
    tpu = jax.default_backend() == "tpu"
    return {"hidden": hidden, "labels": labels, "dtype": "bfloat16",
            "device": jax.devices()[0].device_kind,
            "measured": "Pallas kernels" if tpu else "XLA paths (the kernels need a TPU)",
            "timing": f"kernels: {TRACE_DEVICE_TIME}; baseline: {WALL_CLOCK}" if tpu
            else WALL_CLOCK, "estimate": "v6e, from the compiled schedules "
            "(profiling.v6e.schedule): a model" if estimate else None, "cases": cases}


def main(argv) -> None:
    del argv
    result = run([int(v) for v in FLAGS.vocabs], [int(r) for r in FLAGS.rows], FLAGS.hidden,
                 FLAGS.labels, FLAGS.repeats, FLAGS.trace_dir, FLAGS.estimate)
    print(f"H={result['hidden']} K={result['labels']} on {result['device']}: "
          f"{result['measured']}; timing: {result['timing']}")
    for case in result["cases"]:
        for mode, r in case["modes"].items():
            print(f"V={case['vocab']:6d} R={case['rows']:4d} {mode:20s} "
                  f"{r['hbm_bytes'] / 1e6:9.3f} MB {r['v6e_roofline_s'] * 1e6:8.2f} us(v6e) "
                  f"{r['measured_s'] * 1e3:9.2f} ms(measured)" + (
                      f" {r['v6e_estimate_s'] * 1e6:8.2f} us(v6e estimate, model), "
                      f"{r['estimate_over_roofline']:.2f}x the bound"
                      if "v6e_estimate_s" in r else ""))
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
