"""Which layout of the activations and weights XLA CPU's (Eigen's) dots run fastest in, by
token count: the layers' dense work in four layouts, compiled in one process, timed in turn.

python -m profiling.bench_layer_layout [--model-path P] [--tokens 128,256,512,1024,2048]
    [--rounds 9] [--out layouts.json]
The work: every layer's norms, projections and MLP (SiLU), as the server's CPU programs run
them (a switch on the layer picks its own matrices), random float32 weights of the model's
shapes. Attention is left out: a stand-in adds k + v, repeated over the query heads, to q.
The layouts, activations x weights:
- `token_major`: x [tokens, in] @ w [in, out] (the stacked params' layout);
- `feature_major`: w [out, in] @ x [in, tokens], activations kept transposed throughout (the
  CPU server's up to model.decoder.FEATURE_MAJOR_MAX_TOKENS);
- `feature_major_in_out`: the same activations, weights [in, out] (a transposed operand);
- `token_major_out_in`: x [tokens, in] with weights [out, in] (a transposed operand; the CPU
  server's above that).
Per token count: each layout's median seconds and its time over token_major's, the median of
the rounds' ratios. The layouts must agree (max |difference| reported; over 1e-3, an error).
"""
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from model.config import ModelConfig
from model.loader import load_config
from model.params import expected_shapes
from profiling.bench_forward import layer_flops
from profiling.timing import interleaved_rounds, write_json
from runtime.cli_flags import parse_flags
from runtime.forward_programs import COMPILER_OPTIONS

FLAGS = flags.FLAGS
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# name: (features on axis 0, weights stored [out, in])
LAYOUTS = {"token_major": (False, False), "feature_major": (True, True),
           "feature_major_in_out": (True, False), "token_major_out_in": (False, True)}


def define_flags() -> None:
    flags.DEFINE_string("model_path", None, "model whose shapes to use; default: the embedded "
                        "SmolLM2")
    flags.DEFINE_list("tokens", ["128", "256", "512", "1024", "2048"], "token counts")
    flags.DEFINE_integer("rounds", 9, "timed rounds, each layout once per round")
    flags.DEFINE_string("out", None, "write the results as JSON here")


def random_matrices(cfg: ModelConfig, seed: int = 0) -> list[dict]:
    """Each layer's matrices, [in, out], float32."""
    shapes = {n: expected_shapes(cfg)[n][::-1] for n in MATRICES}  # HF's are [out, in]
    rng = np.random.default_rng(seed)
    return [{n: (rng.standard_normal(s, np.float32) * s[0] ** -0.5) for n, s in shapes.items()}
            for _ in range(cfg.num_layers)]


def _dot_nth(n: int, x, weights: tuple, *, feature_major: bool, out_in: bool):
    w_in = 1 if out_in else 0  # the weights' contracted axis
    if feature_major:  # -> [out, tokens]
        return jax.lax.dot_general(weights[n], x, (((w_in,), (0,)), ((), ())))
    return jax.lax.dot_general(x, weights[n], (((1,), (w_in,)), ((), ())))


def layer_stack(x, matrices: list[dict], *, feature_major: bool, out_in: bool):
    """The layers' dense work on x ([tokens, hidden], or [hidden, tokens] feature-major)."""
    axis = 0 if feature_major else 1
    branches = tuple(functools.partial(_dot_nth, n, feature_major=feature_major, out_in=out_in)
                     for n in range(len(matrices)))

    def dot(x, name, layer):
        return jax.lax.switch(layer, branches, x, tuple(m[name] for m in matrices))

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=axis, keepdims=True) + 1e-6)

    def body(x, layer):
        h = norm(x)
        q, k, v = (dot(h, name, layer) for name in ("wq", "wk", "wv"))
        group = q.shape[axis] // k.shape[axis]
        x = x + dot(q + jnp.tile(k + v, (group, 1) if feature_major else (1, group)), "wo", layer)
        h = norm(x)
        gate, up = dot(h, "w_gate", layer), dot(h, "w_up", layer)
        return x + dot(gate / (1 + jnp.exp(-gate)) * up, "w_down", layer), None

    return jax.lax.scan(body, x, jnp.arange(len(matrices)))[0]


def layout_weights(matrices: list[dict], out_in: bool) -> list[dict]:
    return [{n: jnp.asarray(w.T if out_in else w) for n, w in m.items()} for m in matrices]


def _layout_row(seconds: list[float], base: list[float], flops: int) -> dict:
    median = statistics.median(seconds)
    return {"seconds": median, "flops_per_s": flops / median,
            "vs_token_major": statistics.median(a / b for a, b in zip(seconds, base))}


def run(cfg: ModelConfig, token_counts: list[int], rounds: int) -> dict:
    matrices = random_matrices(cfg)
    weights = {out_in: layout_weights(matrices, out_in) for out_in in (False, True)}
    options = COMPILER_OPTIONS.get(jax.devices()[0].platform, {})
    rows = []
    for tokens in token_counts:
        x = np.random.default_rng(1).standard_normal((tokens, cfg.hidden_size), np.float32)
        calls, outs = [], {}
        for name, (feature_major, out_in) in LAYOUTS.items():
            args = (jnp.asarray(x.T if feature_major else x), weights[out_in])
            fn = jax.jit(functools.partial(layer_stack, feature_major=feature_major,
                                           out_in=out_in)).lower(*args).compile(options)
            calls.append((fn, args))
            out = np.asarray(fn(*args))
            outs[name] = out.T if feature_major else out
        diff = max(float(np.abs(o - outs["token_major"]).max()) for o in outs.values())
        if diff > 1e-3:
            raise AssertionError(f"{tokens} tokens: the layouts disagree by {diff}")
        times = dict(zip(LAYOUTS, interleaved_rounds(calls, rounds)))
        base = times["token_major"]
        flops = cfg.num_layers * layer_flops(cfg, tokens)
        rows.append({"tokens": tokens, "max_abs_difference": diff, "layouts": {
            name: _layout_row(t, base, flops) for name, t in times.items()}})
    return {"model": cfg.family, "device": jax.devices()[0].device_kind,
            "timing": "wall clock after block_until_ready, median; layouts timed in turn",
            "rows": rows}


def main(argv) -> None:
    del argv
    cfg = load_config(FLAGS.model_path)
    result = run(cfg, [int(t) for t in FLAGS.tokens], FLAGS.rounds)
    print(f"{result['model']} layers' dense work, float32 on {result['device']}: ms, and the "
          f"time over token_major's (median of the rounds' ratios)")
    for row in result["rows"]:
        cells = ", ".join(f"{name} {r['seconds'] * 1e3:.1f} ms ({r['vs_token_major']:.3f})"
                          for name, r in row["layouts"].items())
        print(f"{row['tokens']:5d} tokens: {cells}")
    write_json(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
