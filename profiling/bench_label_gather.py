"""Final norm + label gather: bytes moved and v6e roofline of both kernel modes against a
full-logits baseline, at Qwen3-0.6B shapes, plus measured time of the XLA paths here.

python -m profiling.bench_label_gather [--rows 1,8,64,256] [--out results.json]
Baseline: what a server that builds logits does: read the head, write [R, V] float32
logits, read them back for the log-softmax and the gather.
Timing: wall clock after block_until_ready, median of repeats, after a warm-up.
"""
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kernels.label_gather import final_norm_label_gather_reference
from profiling.timing import wall_time, write_json
from runtime.cli_flags import parse_flags

V6E_FLOPS, V6E_HBM = 918e12, 1.64e12
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("rows", ["1", "8", "64", "256"], "scored rows per call")
    flags.DEFINE_integer("vocab", 151936, "vocabulary size")
    flags.DEFINE_integer("hidden", 1024, "hidden size")
    flags.DEFINE_integer("labels", 2, "label ids per row")
    flags.DEFINE_integer("repeats", 3, "timed calls per row count")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def model_bytes(rows: int, vocab: int, hidden: int, labels: int, itemsize: int = 2) -> dict:
    hidden_in = rows * hidden * itemsize
    stream_passes = -(-rows // 256)
    return {
        "labels_only": hidden_in + rows * labels * hidden * itemsize + rows * labels * 4,
        "streamed_logsumexp": hidden_in + stream_passes * vocab * hidden * itemsize
                              + rows * (labels + 1) * 4,
        "full_logits_baseline": hidden_in + vocab * hidden * itemsize + 2 * rows * vocab * 4,
    }


def roofline(rows: int, vocab: int, hidden: int, labels: int, n_bytes: dict) -> dict:
    flops = {"labels_only": 2 * rows * labels * hidden,
             "streamed_logsumexp": 2 * rows * vocab * hidden,
             "full_logits_baseline": 2 * rows * vocab * hidden}
    return {mode: max(flops[mode] / V6E_FLOPS, n_bytes[mode] / V6E_HBM) for mode in n_bytes}


def full_logits_baseline(hidden, norm, head, labels, eps):
    x = hidden * jax.lax.rsqrt(jnp.mean(hidden.astype(jnp.float32) ** 2, -1, keepdims=True) + eps)
    logits = jnp.dot((x * norm).astype(head.dtype), head.T, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels, axis=1)


def measure(rows: int, vocab: int, hidden: int, labels: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((rows, hidden)), jnp.bfloat16),
            jnp.ones(hidden, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.bfloat16),
            jnp.asarray(rng.integers(0, vocab, (rows, labels)), jnp.int32))
    paths = {
        "labels_only": lambda *a: final_norm_label_gather_reference(
            *a, eps=1e-6, with_logsumexp=False)[0],
        "streamed_logsumexp": lambda *a: final_norm_label_gather_reference(
            *a, eps=1e-6, with_logsumexp=True),
        "full_logits_baseline": lambda *a: full_logits_baseline(*a, eps=1e-6),
    }
    return {mode: wall_time(jax.jit(fn), args, repeats) for mode, fn in paths.items()}


def run(rows_list: list[int], vocab: int, hidden: int, labels: int, repeats: int) -> dict:
    table = {}
    for rows in rows_list:
        n_bytes = model_bytes(rows, vocab, hidden, labels)
        table[rows] = {"hbm_bytes": n_bytes,
                       "v6e_roofline_s": roofline(rows, vocab, hidden, labels, n_bytes),
                       "measured_s": measure(rows, vocab, hidden, labels, repeats)}
    return {"vocab": vocab, "hidden": hidden, "labels": labels, "dtype": "bfloat16",
            "measured_backend": f"{jax.default_backend()} XLA paths (kernels run on TPU only)",
            "timing": "wall clock after block_until_ready, median", "rows": table}


def main(argv) -> None:
    del argv
    result = run([int(r) for r in FLAGS.rows], FLAGS.vocab, FLAGS.hidden, FLAGS.labels,
                 FLAGS.repeats)
    print(f"V={result['vocab']} H={result['hidden']} K={result['labels']}; "
          f"measured: {result['measured_backend']}")
    for rows, r in result["rows"].items():
        for mode in r["hbm_bytes"]:
            print(f"R={rows:4d} {mode:22s} {r['hbm_bytes'][mode] / 1e6:10.3f} MB "
                  f"{r['v6e_roofline_s'][mode] * 1e6:9.2f} us(v6e) "
                  f"{r['measured_s'][mode] * 1e3:9.2f} ms(measured)")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
