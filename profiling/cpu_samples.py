"""Where a CPU forward's cycles go, inside the dots too: a sampling profile (Linux `perf`) of one
bucket's forward run in a loop, each sample put in one class.

python -m profiling.cpu_samples [--model-path P] [--buckets 128,512,2048] [--seconds 10]
    [--max-prefill-tokens 2048] [--out cpu_samples.json]
A jax.profiler trace sees a dot as one op. On CPU, XLA hands a float32 dot to Eigen, which
packs blocks of both operands and runs oneDNN's JIT-compiled GEMM kernel on them; the
packing reads the whole weight matrix each call, a cost that only shrinks relative to the
kernel as the rows grow. The classes, by the sample's innermost frame and its call chain:
- `gemm kernel`: JIT code with no XLA frame in its chain (oneDNN's kernels keep no frame
  pointer, so the unwinding stops there);
- `gemm packing`: Eigen's contraction code (`gemm_pack_*`, the contraction's own loops);
- `xla kernels`: JIT code called by XLA's CPU runtime (its fused elementwise kernels);
- `thread pool`: the pool's workers looking for work (stealing, spinning): idle time;
- `os kernel`, `other` (allocation, the runtime's bookkeeping).
Beside the shares: the forward's median wall clock in the loop, and its dense matmuls at the
rate of a 4096^3 float32 matmul timed before and after the loop (as in bench_forward).
Needs `perf` on the PATH, allowed to profile this process (perf_event_paranoid <= 2).
"""
import collections
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

import jax
from absl import app, flags

from profiling.bench_forward import bucket_batch, dense_flops, reference_matmul, study_engine
from profiling.timing import wall_time, write_json
from runtime.cli_flags import parse_flags
from runtime.engine import Engine

FLAGS = flags.FLAGS
CLASSES = ("gemm kernel", "gemm packing", "xla kernels", "thread pool", "os kernel", "other")
_POOL = ("ThreadPool", "RunQueue", "EigenEnvironment")
_PACKING = ("gemm_pack", "TensorContraction", "gebp")
_SAMPLE_HZ = 999


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model to load; default: the embedded SmolLM2")
    flags.DEFINE_integer("max_prefill_tokens", 2048, "the engine's batch budget (largest bucket)")
    flags.DEFINE_list("buckets", ["128", "512", "2048"], "token buckets to profile")
    flags.DEFINE_float("seconds", 10.0, "sampling time per bucket")
    flags.DEFINE_integer("reference_matmul", 4096, "n of the yardstick's n^3 float32 matmul")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def sample_class(frames: list[str]) -> str:
    """`frames`: one sample's call chain as `perf script` prints it, innermost first."""
    top = frames[0]
    if "/perf-" in top:  # JIT code, named by no symbol file
        return "xla kernels" if any("xla::cpu::" in f for f in frames[1:]) else "gemm kernel"
    if any(s in top for s in _PACKING):
        return "gemm packing"
    if any(s in top for s in _POOL):
        return "thread pool"
    return "os kernel" if "[kernel.kallsyms]" in top else "other"


def class_shares(perf_script: str) -> dict:
    """Share of the samples in each class, from `perf script -F tid,ip,sym,dso` of a `perf
    record -g`: one block per sample, the thread id and then its frames."""
    counts = collections.Counter()
    for block in perf_script.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if len(lines) >= 2:
            counts[sample_class(lines[1:])] += 1
    total = sum(counts.values())
    if not total:
        raise ValueError("perf recorded no samples")
    return {"samples": total, **{c: counts[c] / total for c in CLASSES}}


def _perf(*args: str, **kw) -> subprocess.Popen:
    if shutil.which("perf") is None:
        raise RuntimeError("profiling.cpu_samples needs Linux perf on the PATH")
    return subprocess.Popen(["perf", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def sampled(fn, seconds: float) -> tuple[list[float], dict]:
    """Calls `fn` for `seconds` under `perf record` of this process: (each call's seconds,
    class shares)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        recorder = _perf("record", "-F", str(_SAMPLE_HZ), "-g", "-p", str(os.getpid()),
                         "-o", data)
        time.sleep(1.0)  # perf attaches to the process's threads
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        recorder.send_signal(signal.SIGINT)
        _, err = recorder.communicate()  # exits nonzero on SIGINT, having written the data
        if not os.path.exists(data):
            raise RuntimeError(f"perf record failed: {err.strip()}")
        script, _ = _perf("script", "-i", data, "-F", "tid,ip,sym,dso").communicate()
    return times, class_shares(script)


def run(engine: Engine, buckets: list[int], seconds: float, matmul_n: int = 4096) -> dict:
    runner, rows = engine.runner, []
    matmul, matmul_flops = reference_matmul(matmul_n)
    for bucket in buckets:
        entries, labels, shape, batch = bucket_batch(engine, bucket, True)
        forward = lambda: runner.run(batch, shape)  # noqa: E731
        jax.block_until_ready(forward())  # compiles
        rate_before = matmul_flops / wall_time(*matmul, repeats=5)
        times, shares = sampled(forward, seconds)
        rate = (rate_before + matmul_flops / wall_time(*matmul, repeats=5)) / 2
        dense_s = dense_flops(engine.cfg, sum(e.new_tokens for e in entries), len(labels),
                              True) / rate
        median = statistics.median(times)
        rows.append({"bucket": shape.tokens, "forwards": len(times), "measured_s": median,
                     "matmul_flops_per_s": rate, "dense_matmul_s": dense_s,
                     "vs_dense_matmul": median / dense_s, "shares": shares})
    return {"model": engine.cfg.family, "dtype": engine.engine_cfg.dtype,
            "device": jax.devices()[0].device_kind, "sample_hz": _SAMPLE_HZ,
            "timing": "wall clock of ModelRunner.run under perf record, median",
            "buckets": rows}


def main(argv) -> None:
    del argv
    budget = FLAGS.max_prefill_tokens
    engine = study_engine(FLAGS.model_path, "float32", budget)
    result = run(engine, [int(b) for b in FLAGS.buckets], FLAGS.seconds, FLAGS.reference_matmul)
    engine.close()
    print(f"{result['model']} float32 on {result['device']}; shares of perf's samples "
          f"({result['sample_hz']} Hz, every thread)")
    for r in result["buckets"]:
        shares = ", ".join(f"{c} {r['shares'][c]:.1%}" for c in CLASSES)
        print(f"bucket {r['bucket']:5d}: {r['measured_s'] * 1e3:8.1f} ms ({r['forwards']} "
              f"forwards), {r['vs_dense_matmul']:.2f}x dense matmuls at "
              f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; {shares}")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
