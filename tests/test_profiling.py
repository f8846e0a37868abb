import json
import os
import subprocess
import sys

import numpy as np
import pytest

from profiling.bench_engine import run, workload
from tests.conftest import OLDER_FUSION_EMITTERS
from tests.tiny_models import VOCAB


def test_bench_engine_measures_every_mode(model_dirs, engines):
    from runtime.engine import Engine
    from tests.tiny_models import small_config
    uncached = Engine.from_path(model_dirs["qwen3"], small_config(prefix_cache=False))
    reqs = workload(VOCAB, query_tokens=12, item_tokens=3, num_items=4, num_labels=2, requests=4,
                    distinct_queries=2)
    assert [r.query for r in reqs[:2]] != [reqs[0].query] * 2 and reqs[2].query == reqs[0].query
    result = run({True: engines["qwen3"], False: uncached}, reqs, repeats=1)
    uncached.close()
    assert set(result["modes"]) == {f"{m}/prefix_{p}" for m in ("multi_item", "prompt_per_item")
                                    for p in ("on", "off")}
    for row in result["modes"].values():
        assert row["items_per_s"] > 0 and row["latency_s"] > 0
    assert result["shape"]["requests"] == 4


def test_bench_engine_cli_writes_json(model_dirs, tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "profiling.bench_engine", "--model_path",
                    model_dirs["llama"], "--query_tokens", "8", "--item_tokens", "2",
                    "--num_items", "3", "--requests", "2", "--repeats", "1",
                    "--max_prefill_tokens", "256", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    assert json.loads(out.read_text())["shape"]["num_items"] == 3


@pytest.mark.parametrize("backend", ["reference", "xla", "interpret"])
def test_bench_attention_reports_work_and_time(backend):
    from profiling.bench_attention import Heads, run
    result = run(["mis_120q_10x18", "mis_120q_64x18"], backend, repeats=1,
                 heads=Heads(q=2, kv=1, dim=64, page=16), q_block=64, kv_block=64,
                 estimate=backend == "xla")
    small, large = result["shapes"]["mis_120q_10x18"], result["shapes"]["mis_120q_64x18"]
    assert large["kv_blocks_visited"] < large["kv_blocks_dense_causal"]
    assert small["flops"] == 4 * small["kv_blocks_visited"] * 2 * 64 * 64 * 64
    for row in (small, large):
        assert row["measured_s"] > 0 and row["v6e_roofline_s"] > 0
        assert row["v6e_fraction"] == pytest.approx(row["v6e_roofline_s"] / row["measured_s"])
        if backend == "xla":  # the model: the kernel compiled for v6e, at the plan's steps
            assert 0 < row["estimate_fraction_of_roofline"] < 1
            assert row["v6e_estimate_s"] > row["kv_blocks_visited"] * row["step_bundles"] / 2e9
            assert row["step_units"]["mxu"] > 0 and row["step_units"]["eup"] > 0
    if backend == "xla":  # make_batch's pages follow each other: every block one copy
        for row in (small, large):  # blocks of 64 take no tiles of 128
            assert row["whole_block_steps"] == row["kv_blocks_visited"] and row["tile_runs"] == []


def test_bench_label_gather_reports_work_roofline_and_time(tmp_path):
    from profiling.bench_label_gather import MODES, run
    result = run([3000], [16], hidden=64, labels=2, repeats=1, trace_dir=str(tmp_path),
                 estimate=True)  # one row, other vocabularies: test_label_gather_kernel
    assert [(c["vocab"], c["rows"]) for c in result["cases"]] == [(3000, 16)]
    for case in result["cases"]:
        rows, vocab, modes = case["rows"], case["vocab"], case["modes"]
        assert set(modes) == set(MODES)
        b = {mode: row["hbm_bytes"] for mode, row in modes.items()}
        assert b["labels_only"] < b["streamed_logsumexp"] < b["full_logits_baseline"]
        assert b["full_logits_baseline"] - b["streamed_logsumexp"] >= 2 * rows * vocab * 4 - 4 * (
            rows * 3)
        assert modes["labels_only"]["flops"] == 2 * rows * 2 * 64 * 8  # a tile of 8 head rows
        for row in modes.values():
            assert row["measured_s"] > 0 and 0 < row["v6e_fraction"] < 1
        for mode in ("labels_only", "streamed_logsumexp"):  # the model, never under HBM
            assert modes[mode]["estimate_over_roofline"] >= 0.99
    assert len(list(tmp_path.rglob("*.xplane.pb"))) == len(MODES)  # a trace per measurement


def test_op_time_reads_named_ops_from_a_profiler_trace(tmp_path):
    import jax
    import jax.numpy as jnp

    from profiling.timing import op_time
    fn = jax.jit(lambda x: jnp.sin(x @ x).sum())
    x = jnp.ones((256, 256))
    # "sin": XLA:CPU's older fusion emitters (tests/conftest.py) name the op without "sine"
    seconds = op_time(fn, (x,), "sin", repeats=2, trace_dir=str(tmp_path))
    assert seconds is not None and 0 < seconds < 10
    assert list(tmp_path.rglob("*.xplane.pb"))  # a trace TensorBoard can open
    assert op_time(fn, (x,), "no_such_kernel", repeats=1) is None


def test_bench_score_drives_a_server_and_reports_latency(engines, tmp_path):
    import asyncio

    from profiling.bench_score import run
    from server.app import ServerConfig
    from tests.server_harness import metric, serving
    with serving(engines["llama"], ServerConfig(trace_dir=str(tmp_path))) as port:
        before = int(metric(port, "jax_score_items_scored_total"))
        result = asyncio.run(run(f"http://127.0.0.1:{port}", qps=20, duration=1.5, num_items=3,
                                 query_tokens=10, item_tokens=2, num_labels=2, concurrency=4,
                                 distinct_queries=2, profile=True))
        scored = int(metric(port, "jax_score_items_scored_total")) - before
    assert result["requests"] > 10 and result["ok"] == result["requests"]
    assert result["errors"] == 0 and scored == 3 * result["ok"]
    lat = result["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert result["items_per_s"] == pytest.approx(3 * result["req_per_s"])
    assert result["server_trace_dir"] == str(tmp_path) and list(tmp_path.rglob("*.xplane.pb"))


def test_bench_score_cli_counts_errors_and_writes_json(engines, tmp_path):
    from server.app import ServerConfig
    from tests.server_harness import serving
    out = tmp_path / "score.json"
    with serving(engines["llama"], ServerConfig(max_pending=0)) as port:  # every score is a 503
        subprocess.run([sys.executable, "-m", "profiling.bench_score", "--url",
                        f"http://127.0.0.1:{port}", "--qps", "20", "--duration", "0.5",
                        "--num-items", "2", "--query-tokens", "4", "--item-tokens", "1",
                        "--num-labels", "1", "--out", str(out)],
                       check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["ok"] == 0 and result["errors"] == result["requests"] > 0
    assert result["error_statuses"] == {"503": result["requests"]}
    assert result["latency_s"]["p50"] is None


def test_bench_forward_cli_times_the_buckets_asked_and_traces(model_dirs, tmp_path):
    out, traces = tmp_path / "forward.json", tmp_path / "traces"
    subprocess.run([sys.executable, "-m", "profiling.bench_forward", "--model-path",
                    model_dirs["llama"], "--max-prefill-tokens", "64", "--repeats", "1",
                    "--buckets", "16,64", "--noestimate",  # v6e_estimate: test_tpu_schedule
                    "--reference-matmul", "256", "--trace-dir", str(traces), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    rows = result["buckets"]
    assert [r["bucket"] for r in rows] == [16, 64]
    assert all(1 < r["tokens"] <= r["bucket"] and r["rows"] >= 1 for r in rows)
    assert all(r["measured_s"] > 0 and r["v6e_roofline_s"] > 0 for r in rows)
    assert rows[-1]["flops"] > rows[0]["flops"]
    assert all(r["matmul_flops_per_s"] > 0 and r["v6e_estimate"] is None for r in rows)
    for r in rows:
        assert r["vs_dense_matmul"] == pytest.approx(r["measured_s"] / r["dense_matmul_s"])
        # one round: its multiple is the medians' multiple
        assert r["vs_dense_matmul_by_round"] == pytest.approx(r["vs_dense_matmul"])
        assert r["vs_dense_matmul_best"] == pytest.approx(r["vs_dense_matmul"])
        assert r["build_batch_s"] > 0
        split = r["split_s"]
        for scope in ("qkv", "out_proj", "mlp", "attention", "kv_write", "label_gather"):
            assert split[scope] > 0, scope  # every scope's ops were found in the trace
        assert split["executions"] > 0
    assert sorted(p.parent.parent.parent.parent.name for p in traces.rglob("*.xplane.pb")) == [
        f"bucket_{b}" for b in sorted(["16", "64"])]


def _xla_cpu_defaults() -> dict:
    """The environment with XLA:CPU's own fusion emitters, which the suite swaps for faster
    compiling ones (tests/conftest.py): the older ones leave no scatter in the optimized HLO
    whose ops the ablation counts."""
    flags = os.environ["XLA_FLAGS"].replace(OLDER_FUSION_EMITTERS, "")
    return dict(os.environ, XLA_FLAGS=flags)


def test_bench_ablation_replaces_only_the_part_it_names(model_dirs, tmp_path):
    out = tmp_path / "ablation.json"
    subprocess.run([sys.executable, "-m", "profiling.bench_ablation", "--model-path",
                    model_dirs["llama"], "--max-prefill-tokens", "64", "--buckets", "64",
                    "--rounds", "2", "--reference-matmul", "256", "--out", str(out)],
                   check=True, capture_output=True, timeout=300, env=_xla_cpu_defaults())
    [row] = json.loads(out.read_text())["buckets"]
    assert row["bucket"] == 64 and 1 < row["tokens"] <= 64 and row["rows"] >= 1
    variants = row["variants"]
    assert list(variants) == ["full", "without_attention", "without_label_gather",
                              "kv_write_twice", "bare"]
    assert variants["full"]["vs_full"] == 1.0
    assert all(v["seconds"] > 0 and v["vs_full"] > 0 for v in variants.values())
    assert row["full_vs_dense"] == pytest.approx(
        variants["full"]["seconds"] / row["dense_matmul_s"])
    ops = {name: v["ops"] for name, v in variants.items()}
    # each stand-in drops its own dots; the second write keeps every dot, adds its scatters
    attention, gather = (ops["full"]["dot"] - ops[f"without_{p}"]["dot"]
                         for p in ("attention", "label_gather"))
    assert attention > 0 and gather > 0
    assert ops["bare"]["dot"] == ops["full"]["dot"] - attention - gather
    assert ops["kv_write_twice"]["dot"] == ops["full"]["dot"]
    assert ops["kv_write_twice"]["scatter"] > ops["full"]["scatter"] > 0


def test_a_study_batch_fits_its_bucket_on_the_cpu_and_on_a_page_aligned_v6e():
    """Qwen3-0.6B's 2048-token bucket filled for a CPU engine: a v6e server pads each sequence
    to whole pages, and the same sequences fill its 2048-token bucket too (filled to the
    token, seven SGLang-shaped sequences padded to 2080 tokens had overflowed it)."""
    import jax
    import numpy as np

    from profiling.bench_forward import schedule
    from profiling.v6e.compile import SIZED_MODELS, v6e_devices
    from runtime.engine_config import EngineConfig
    cfg, engine_cfg = SIZED_MODELS["Qwen3-0.6B"], EngineConfig(
        max_prefill_tokens=2048, max_seqs=64, max_rows=256)
    cpu, v6e = (engine_cfg.buckets(cfg, d) for d in (jax.devices("cpu")[0], v6e_devices(1)[0]))
    assert v6e.page_aligned and not cpu.page_aligned
    entries, labels, shape = schedule(cpu, cfg.vocab_size, 2048, np.random.default_rng(0))
    new_tokens = [e.new_tokens for e in entries]
    assert shape.tokens == 2048 and sum(new_tokens) > 2048 - cpu.page_size * len(entries)
    assert v6e.shape_of(new_tokens, len(labels), len(entries)).tokens == 2048


def test_the_forwards_attention_work_counts_the_rows_the_xla_block_steps_take(embedded_config):
    """16 tokens, CPU's q blocks of 128: the XLA loop's block step takes the batch's 16 rows
    a head, the Pallas kernel's a whole q block, and the work counts each one's."""
    import jax.numpy as jnp
    import numpy as np

    from kernels.attention_plan import build_plan, default_block_sizes
    from profiling.bench_forward import attention_work
    from tests.attention_cases import random_batch
    _, _, _, md, _ = random_batch(np.random.default_rng(0), [("causal", 11)], hq=1, hkv=1, d=8,
                                  page_size=16, dtype=jnp.float32)
    sizes = default_block_sizes("xla cpu", 16)
    plan = build_plan(md.cu_q_lens, md.kv_lens, md.shared_lens, md.visible_from, sizes,
                      page_size=16)
    assert len(plan.token_pos) == 16 and plan.items.num_steps == 0
    xla, pallas = (attention_work(embedded_config, plan, sizes, 4, backend)
                   for backend in ("xla", "pallas"))
    assert xla.flops * sizes.q_block == pallas.flops * 16 > 0


def test_a_windowed_models_work_counts_each_layer_at_its_plan():
    """Gemma-3-1B's shape on v6e blocks, a 2048-token bucket of one 1024-token query and 56
    items: its 22 windowed layers (W = 512) run the window's plan, the 4 others the full one;
    the window hides half the query's keys from the items' rows, a third of the work."""
    import dataclasses

    import numpy as np

    from kernels.attention_plan import host_plan
    from model.decoder import plan_windows
    from model.params import param_shapes
    from profiling.bench_forward import attention_work, filled_batch, work
    from profiling.bench_host_work import bucket_config
    from profiling.v6e.compile import WINDOWED_MODELS
    from profiling.v6e.forward_estimate import v6e_batch
    cfg = WINDOWED_MODELS["Gemma-3-1B"]
    assert plan_windows(cfg) == [0 if (i + 1) % 6 == 0 else 512 for i in range(26)]
    engine_cfg = bucket_config(2048, "bfloat16")
    entries, labels = filled_batch(engine_cfg, cfg.vocab_size, np.random.default_rng(0),
                                   query_len=1024, items=56)
    assert len(entries[0].seq.score_rows) == 56
    _, batch, sizes = v6e_batch(cfg, engine_cfg, entries, labels)
    params = {"layers": {k: np.empty(0) for k in param_shapes(cfg)["layers"]}}
    args = (batch, 2048, len(labels), sizes, engine_cfg.page_size, True, 2, "pallas")
    windowed, unwindowed = (work(c, params, *args)[0]
                            for c in (cfg, dataclasses.replace(cfg, layer_windows=())))
    full, window = (attention_work(cfg, host_plan(batch.attention, sizes, engine_cfg.page_size,
                                                  w), sizes, 2, "pallas").flops
                    for w in (0, 512))
    assert window < 0.75 * full
    assert unwindowed - windowed == pytest.approx(22 * (full - window))


def test_an_int8_models_work_counts_its_projections_at_the_int8_rate():
    """Qwen3-0.6B at 2,048 tokens in int8 (W8A8): its projections' and MLP's FLOPs are int8
    ops, which the roofline prices at 1,836 TOPS, and its linears' weights a byte each."""
    import dataclasses

    import jax
    import numpy as np

    from model.params import param_dtypes, param_shapes
    from profiling.bench_forward import filled_batch, layer_flops, work
    from profiling.bench_host_work import bucket_config
    from profiling.v6e.compile import STUDY_MODELS
    from profiling.v6e.forward_estimate import v6e_batch
    from profiling.v6e.roofline import roofline
    cfg = STUDY_MODELS["Qwen3-0.6B"]
    engine_cfg = bucket_config(2048, "bfloat16")
    entries, labels = filled_batch(engine_cfg, cfg.vocab_size, np.random.default_rng(0))
    _, batch, sizes = v6e_batch(cfg, engine_cfg, entries, labels)
    done = {}
    for c in (cfg, dataclasses.replace(cfg, quantization="int8")):
        params = jax.tree.map(jax.ShapeDtypeStruct, param_shapes(c), param_dtypes(c, "bfloat16"),
                              is_leaf=lambda x: isinstance(x, tuple))
        done[c.quantization] = work(c, params, batch, 2048, len(labels), sizes,
                                    engine_cfg.page_size, True, 2, "pallas")
    (flops, hbm, none), (rest, int8_hbm, int8_ops) = done[""], done["int8"]
    assert none == 0 and int8_ops == cfg.num_layers * layer_flops(cfg, 2048)
    assert rest + int8_ops == flops
    linears = sum(np.prod(s) for k, s in param_shapes(cfg)["layers"].items()
                  if k.startswith("w"))
    scales = sum(np.prod(s) for k, s in param_shapes(
        dataclasses.replace(cfg, quantization="int8"))["layers"].items()
        if k.endswith("_scale"))
    assert hbm - int8_hbm == linears - 2 * scales
    bf16, int8 = roofline(flops, hbm, None), roofline(rest, int8_hbm, None, int8_ops)
    assert bf16["bound_by"] == "compute"  # int8's half the MXU time: HBM's, here
    assert int8["v6e_roofline_s"] == pytest.approx(max((rest + int8_ops / 2) / 918e12,
                                                       int8_hbm / 1.64e12))
    assert int8["v6e_roofline_s"] < 0.7 * bf16["v6e_roofline_s"]


def test_bench_layer_layout_times_every_layout_on_the_same_work(model_dirs, tmp_path):
    out = tmp_path / "layouts.json"
    subprocess.run([sys.executable, "-m", "profiling.bench_layer_layout", "--model-path",
                    model_dirs["llama"], "--tokens", "8,32", "--rounds", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [8, 32]
    for r in rows:
        assert r["max_abs_difference"] < 1e-3  # the four layouts compute the same thing
        assert set(r["layouts"]) == {"token_major", "feature_major", "feature_major_in_out",
                                     "token_major_out_in"}
        assert r["layouts"]["token_major"]["vs_token_major"] == 1.0
        assert all(t["seconds"] > 0 and t["flops_per_s"] > 0 for t in r["layouts"].values())


def test_trace_breakdown_takes_self_time_and_the_first_named_scope():
    from profiling.trace_breakdown import completed, scope_of, self_times
    events = [{"tid": 1, "ts": 0, "dur": 10, "name": "while"},  # holds the next two
              {"tid": 1, "ts": 1, "dur": 3, "name": "dot"},
              {"tid": 1, "ts": 5, "dur": 4, "name": "exp"},
              {"tid": 2, "ts": 2, "dur": 6, "name": "copy"}]  # another thread: not nested
    assert sorted(self_times(events)) == [(1, "dot", 3), (1, "exp", 4), (1, "while", 3),
                                          (2, "copy", 6)]
    # An asynchronous dot, handed off at 1 and completed at 6 (the marker on another thread),
    # while the exp starts at 5: each op owns the time it is the latest started.
    events += [{"tid": 2, "ts": 6, "dur": 0, "name": "end: dot"},
               {"tid": 1, "ts": 9.5, "dur": 0, "name": "end: exp"}]
    spanned = completed(events, {"dot"})
    assert [e["dur"] for e in spanned] == [10, 5, 4, 6, 0, 0]  # only the async op is spanned
    assert sorted(t for t in self_times(spanned) if t[1] in ("dot", "exp", "while")) == [
        (1, "dot", 4), (1, "exp", 4), (1, "while", 2)]
    scopes = ("qkv", "attention", "mlp")
    assert scope_of("jit(f)/while/body/layer/attention/while/body/exp", scopes) == "attention"
    assert scope_of("jit(f)/while/body/layer/mlp/dot_general", scopes) == "mlp"
    assert scope_of("jit(f)/while/body/dynamic_slice", scopes) == "other"


def test_op_scopes_name_an_unnamed_instruction_by_its_computation():
    """A dot the compiler rewrote without metadata belongs to its neighbours' scope."""
    from profiling.trace_breakdown import op_scopes
    text = """HloModule m
%branch (p: f32[64]) -> f32[1,1000] {
  %bitcast.1 = f32[64]{0} bitcast(%p), metadata={op_name="jit(f)/label_gather/cond/dot"}
  %dot.1 = f32[1,1000]{1,0} dot(%bitcast.1, %e), lhs_contracting_dims={0}
  ROOT %exp.1 = f32[1,1000]{1,0} exponential(%dot.1), metadata={op_name="jit(f)/label_gather/exp"}
}
ENTRY %main (p: f32[64]) -> f32[1,1000] {
  %copy.2 = f32[64]{0} copy(%p)
  ROOT %cond.3 = f32[1,1000] conditional(%copy.2), metadata={op_name="jit(f)/mlp/cond"}
}
"""
    scopes = op_scopes(type("Compiled", (), {"as_text": lambda self: text})())
    assert scopes == {"bitcast.1": "jit(f)/label_gather/cond/dot",
                      "dot.1": "jit(f)/label_gather/cond/dot",
                      "exp.1": "jit(f)/label_gather/exp",
                      "copy.2": "jit(f)/mlp/cond", "cond.3": "jit(f)/mlp/cond"}


def test_bench_compare_measures_a_started_server(model_dirs):
    import asyncio

    from profiling.bench_compare import serve_shape, shape_requests
    from profiling.score_client import server_vocab
    from profiling.server_process import running_server
    args = "--max-prefill-tokens 64 --max-seqs 8 --max-rows 64 --page-size 8 --skip-warmup"
    with running_server(model_dirs["llama"], args) as (url, devices, start_s, _):
        reqs = shape_requests(asyncio.run(server_vocab(url)),
                              {"query_tokens": 6, "item_tokens": 2, "num_items": 3}, requests=4)
        row, scores = asyncio.run(serve_shape(url, reqs, clients=2, repeats=1))
    assert row["items_per_s"] > 0 and row["latency_s"] > 0
    assert 0 <= row["padding"] < 1  # 12-token requests pad to buckets of 16 and more
    assert scores.shape == (3, 2) and ((scores > 0) & (scores < 1)).all()
    assert devices == "1 of 1 cpu device(s)" and start_s > 0


def test_bench_compare_says_why_the_server_did_not_start(model_dirs):
    from profiling.server_process import running_server
    with pytest.raises(RuntimeError, match=r"exited with 1 before serving:(.|\n)*--tp-size"):
        with running_server(model_dirs["llama"], "--tp-size 3 --skip-warmup"):
            pass


def test_bench_engine_traces_each_mode(model_dirs, engines, tmp_path):
    from runtime.engine import Engine
    from tests.tiny_models import small_config
    uncached = Engine.from_path(model_dirs["llama"], small_config(prefix_cache=False))
    reqs = workload(VOCAB, query_tokens=6, item_tokens=2, num_items=2, num_labels=1, requests=2,
                    distinct_queries=1)
    result = run({True: engines["llama"], False: uncached}, reqs, repeats=1,
                 trace_dir=str(tmp_path))
    uncached.close()
    assert result["traced"] == str(tmp_path)
    runs = {p.parent.parent.parent.parent.name for p in tmp_path.rglob("*.xplane.pb")}
    assert runs == {f"{m}_prefix_{p}" for m in ("multi_item", "prompt_per_item")
                    for p in ("on", "off")}


def test_server_profile_endpoints_write_a_trace_with_named_spans(model_dirs, tmp_path):
    import gzip

    from runtime.engine import Engine
    from server.app import ServerConfig
    from tests.server_harness import OK, call, serving
    from tests.tiny_models import small_config
    engine = Engine.from_path(model_dirs["llama"], small_config())
    with serving(engine, ServerConfig(trace_dir=str(tmp_path))) as p:
        assert call(p, "POST", "/stop_profile")[0] == 409  # none running
        assert call(p, "POST", "/start_profile")[:2] == (200, {"trace_dir": str(tmp_path)})
        assert call(p, "POST", "/start_profile")[0] == 409  # one at a time
        assert call(p, "POST", "/v1/score", OK)[0] == 200
        assert call(p, "POST", "/stop_profile")[:2] == (200, {"trace_dir": str(tmp_path)})
    engine.close()
    trace, = tmp_path.rglob("*.trace.json.gz")
    names = {e.get("name") for e in json.load(gzip.open(trace))["traceEvents"]}
    assert {"http_request", "parse_request", "tokenize", "form_batch", "build_batch",
            "dispatch", "collect"} <= names  # host-side spans
    xplane = next(tmp_path.rglob("*.xplane.pb")).read_bytes()
    for scope in (b"layer/qkv", b"layer/kv_write", b"layer/attention", b"layer/mlp",
                  b"label_gather"):
        assert scope in xplane  # named scopes of the compiled forward


@pytest.mark.parametrize("study, args", [  # their estimates: the two tests of run() above
    ("bench_attention", ["--shapes", "mis_120q_10x18", "--q-block", "64", "--kv-block", "64",
                         "--noestimate"]),
    ("bench_label_gather", ["--vocabs", "3000", "--rows", "1,8", "--hidden", "64",
                            "--noestimate"])])
def test_kernel_study_clis_write_json_and_traces(study, args, tmp_path):
    out, traces = tmp_path / "result.json", tmp_path / "traces"
    done = subprocess.run([sys.executable, "-m", f"profiling.{study}", *args, "--repeats", "1",
                           "--trace-dir", str(traces), "--out", str(out)],
                          check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["timing"].startswith("wall clock") and "timing: wall clock" in done.stdout
    assert list(traces.rglob("*.xplane.pb"))


def test_bench_tpu_compile_cli_reports_memory_and_compiler_estimates(tmp_path):
    out = tmp_path / "tpu_compile.json"
    done = subprocess.run([sys.executable, "-m", "profiling.bench_tpu_compile", "--models",
                           "SmolLM2-135M", "--buckets", "16", "--max-prefill-tokens", "512",
                           "--out", str(out)], check=True, capture_output=True, text=True,
                          timeout=600)
    assert "compiler estimates" in done.stdout
    (model,) = json.loads(out.read_text())["models"]
    assert model["pool_bytes_per_chip"] > 20 * 2**30  # a 32 GiB chip, less 0.3 GB of weights
    assert [c["bucket"] for c in model["cases"]] == [16]
    for case in model["cases"]:
        assert case["hbm"]["alias"] == model["pool_bytes_per_chip"]
        assert case["hbm"]["temp"] < 2**20 * 16 and case["compile_s"] > 0
        assert case["xla"]["flops"] > 0 and case["xla"]["optimal_s"] > 0
        assert case["roofline"]["v6e_roofline_s"] > 0


def test_random_checkpoint_of_each_sized_model_has_its_config(tmp_path):
    """The checkpoint GPU comparisons time in place of a downloaded model is the one sized."""
    import dataclasses

    from model.config import config_from_hf
    from model.loader import load_model
    from profiling.random_checkpoint import config_json, write_checkpoint
    from profiling.v6e.compile import SIZED_MODELS, WINDOWED_MODELS
    for cfg in (*SIZED_MODELS.values(), *WINDOWED_MODELS.values()):
        assert config_from_hf(config_json(cfg)) == cfg
    small = dataclasses.replace(SIZED_MODELS["Qwen3-0.6B"], vocab_size=512, hidden_size=64,
                                intermediate_size=96, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16)
    loaded, params, _ = load_model(write_checkpoint(str(tmp_path), config_json(small), std=0.02))
    assert loaded == small and params["embed"].shape == (512, 64)


PERF_SAMPLES = """13871
\t    7fe61c317cd9 [unknown] (/tmp/perf-13866.map)
\tbc85d391be3965bc [unknown] ([unknown])

13872
\t    7fe65001723c [unknown] (/tmp/perf-13866.map)
\t         91c7577 xla::cpu::Worker::Parallelize<xla::cpu::Kernel::Task<true> > (libjax_common.so)
\t         7987e04 Eigen::ThreadPoolTempl<Env>::WorkerLoop (libjax_common.so)

13871
\t    55d0 Eigen::internal::gemm_pack_colmajor_block<float, long>::operator() (libjax_common.so)
\t    7987e04 Eigen::ThreadPoolTempl<Env>::WorkerLoop (libjax_common.so)

13872
\t    7987a10 Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>::GlobalSteal (libjax_common.so)

13871
\t    ffffffff8110 finish_task_switch.isra.0 ([kernel.kallsyms])

13872
\t    9a110 _int_malloc (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""


def test_cpu_samples_class_each_sample_by_its_frames():
    from profiling.cpu_samples import CLASSES, class_shares
    shares = class_shares(PERF_SAMPLES)
    assert shares["samples"] == 6
    assert [shares[c] for c in CLASSES] == [1 / 6] * 6  # one sample of each class, in order
    with pytest.raises(ValueError, match="no samples"):
        class_shares("")


def test_cpu_samples_cli_profiles_each_bucket_asked(model_dirs, tmp_path):
    from profiling.cpu_samples import CLASSES
    out = tmp_path / "cpu_samples.json"
    done = subprocess.run([sys.executable, "-m", "profiling.cpu_samples", "--model-path",
                           model_dirs["llama"], "--max-prefill-tokens", "64", "--buckets",
                           "16,64", "--seconds", "1", "--reference-matmul", "256", "--out",
                           str(out)], check=True, capture_output=True, text=True, timeout=300)
    assert "shares of perf's samples" in done.stdout
    rows = json.loads(out.read_text())["buckets"]
    assert [r["bucket"] for r in rows] == [16, 64]
    for r in rows:
        assert r["forwards"] > 0 and r["shares"]["samples"] > 100  # 1 s at 999 Hz, or more
        assert sum(r["shares"][c] for c in CLASSES) == pytest.approx(1)
        assert r["vs_dense_matmul"] == pytest.approx(r["measured_s"] / r["dense_matmul_s"])


def test_bench_serving_loads_a_started_server_and_reads_its_counters(tmp_path):
    """Text requests (the tokenizer in the path) from two clients for a second: every one
    answered, the forward counters read, the per-request path timed by stage."""
    from profiling.bench_serving import run, tiny_checkpoint
    model = tiny_checkpoint(str(tmp_path / "tiny"))
    result = run(model, ["."], [2], duration=1.0, warmup=0.5, text=True, window=0.5,
                 server_args="--max-prefill-tokens 1024 --skip-warmup", shelf=30)
    (row,) = result["servers"]["."]["levels"]
    assert row["requests"] > 0 and row["errors"] == 0 and row["items_per_s"] > 0
    assert row["requests_per_forward"] >= 1 and 0 < row["forward_in_flight_share"] <= 1
    assert row["scheduler_cpu_ms_per_forward"] > 0 and row["server_cpu_ms_per_request"] > 0
    assert len(row["items_per_s_by_window"]) == 2
    assert row["texts_cached_share"] is None or 0 <= row["texts_cached_share"] <= 1
    path = result["request_path_us"]
    assert set(path) == {"http_read", "parse", "prepare", "answer", "total"}
    assert all(v > 0 for v in path.values())


def test_bench_serving_draws_a_requests_items_from_a_shelf():
    import json

    from profiling.bench_serving import SHAPE, Bodies
    bodies = Bodies(320, 0, count=20, shelf=12)
    reqs = [json.loads(bodies.next()) for _ in range(20)]
    assert len({tuple(r["query"]) for r in reqs}) == 20  # each request its own query
    assert all(len({tuple(i) for i in r["items"]}) == SHAPE["num_items"] for r in reqs)
    assert len({tuple(i) for r in reqs for i in r["items"]}) == 12
    with pytest.raises(ValueError, match="a shelf of 5 items is less than a request's 10"):
        Bodies(320, 0, count=2, shelf=5)


def test_bench_serving_can_tokenize_with_the_embedded_models_tokenizer(tmp_path):
    """--embedded_tokenizer: the tiny checkpoint with SmolLM2's tokenizer and a vocabulary its
    size, read back as the server reads it: the same ids as the GGUF's own tokenizer."""
    from model.loader import load_front
    from profiling.bench_serving import tiny_checkpoint
    model = tiny_checkpoint(str(tmp_path / "tiny"), embedded_tokenizer=True)
    front_cfg, saved = load_front(model)
    embedded = load_front(None)[1]
    assert front_cfg.vocab_size == saved.vocab_size == embedded.vocab_size == 49152
    text = ["Tokyo is the capital of Japan, 1,234 km away", " a shelf item"]
    assert saved.encode_pieces(text) == embedded.encode_pieces(text)


def test_a_simulated_chip_holds_forwards_one_after_another_without_cpu(tmp_path):
    """Two forwards dispatched at once end after both estimates, the chip's log holds their
    seconds and count, and waiting for them takes no CPU; the times interpolate linearly
    between buckets and refuse a table that could not be one."""
    import time

    from profiling.simulated_chip import ChipLog, ForwardTimes, SimulatedDevice, SimulatedRunner
    from runtime.buckets import BatchShape
    times = ForwardTimes("m", (128, 512), (0.1, 0.2))
    assert times.of(64) == 0.1 and times.of(320) == pytest.approx(0.15)
    assert times.of(896) == pytest.approx(0.3)  # the last two buckets' slope beyond them
    with pytest.raises(ValueError, match="increasing token counts"):
        ForwardTimes("m", (512, 128), (0.1, 0.2))
    log = ChipLog(str(tmp_path / "chips"), 2, create=True)
    runner = SimulatedRunner(None, None, None, 8, None, None, [SimulatedDevice(1)],
                             times=times, log=log)
    shape = BatchShape(tokens=128, seqs=2, pages_per_seq=4, rows=3, labels=2)
    start, cpu = time.perf_counter(), time.thread_time()
    first, second = runner.dispatch(None, shape), runner.dispatch(None, shape)
    logits, lse = runner.collect(first)
    runner.collect(second)
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    assert wall >= 0.2 and cpu < 0.5 * wall
    assert logits.shape == (3, 2) and lse.shape == (3,)
    np.testing.assert_allclose(ChipLog(str(tmp_path / "chips"), 2).read(), [[0, 0], [0.2, 2]])


def test_bench_serving_on_simulated_chips_reports_each_chips_busy_share(tmp_path):
    """The server on two simulated v6e chips (one a replica), loaded by four clients: both
    chips hold forwards, as many as the server counts, and their busy shares are reported."""
    from profiling.bench_serving import run, tiny_checkpoint
    model = tiny_checkpoint(str(tmp_path / "tiny"))
    result = run(model, ["."], [4], duration=1.0, warmup=0.5, text=False,
                 server_args="--max-prefill-tokens 1024 --skip-warmup", chip="Qwen3-0.6B",
                 chips=2)
    (row,) = result["servers"]["."]["levels"]
    assert row["requests"] > 0 and row["errors"] == 0
    assert len(row["chip_busy"]) == 2 and all(0 < b <= 1 for b in row["chip_busy"])
    assert abs(sum(row["chip_forwards"]) - row["forwards"]) <= 2 * 2  # in flight at the ends
    assert result["chip"] == {"model": "Qwen3-0.6B", "chips": 2}


def test_bench_host_work_times_the_schedulers_cpu_per_forward(tmp_path):
    import numpy as np

    from profiling.bench_host_work import forward_requests, run
    from profiling.bench_serving import tiny_checkpoint
    reqs = forward_requests(512, 320, np.random.default_rng(0))
    assert sum(len(r.query) + sum(map(len, r.items)) for r in reqs) == 512  # one bucket full
    result = run(tiny_checkpoint(str(tmp_path / "tiny")), [128], forwards=4, estimate=False)
    (row,) = result["buckets"]
    assert row["bucket"] == 128 and row["forwards"] >= 4 and row["host_ms_median"] > 0


def test_figures_draws_the_roofline_and_the_comparison_from_study_outputs(tmp_path):
    """Study JSON in, PNG files out: the estimated points sit where their FLOPs, bytes and
    times put them, and the recorded comparisons in docs/figures/data read as the studies
    write them."""
    import glob
    import pathlib

    from profiling import figures
    forward = {"model": "llama", "buckets": [
        {"bucket": 128, "v6e_estimate": {"flops": 2e11, "hbm_bytes": 4e8, "seconds": 1e-3}},
        {"bucket": 512, "v6e_estimate": None}]}
    attention = {"shapes": {"mis_120q_10x18": {"flops": 1.6e9, "hbm_bytes": 9.4e6,
                                               "v6e_estimate_s": 1.3e-5},
                            "causal_4096": {"flops": 7.3e10, "hbm_bytes": 1.8e8,
                                            "v6e_estimate_s": 3.6e-4},
                            "mis_120q_64x18": {"flops": 9.1e9, "hbm_bytes": 4.6e7}}}
    label_gather = {"cases": [
        {"vocab": 151936, "rows": 8, "modes": {"rows": {"flops": 1e6, "hbm_bytes": 1e5,
                                                        "v6e_estimate_s": 1e-6}}},
        {"vocab": 151936, "rows": 256, "modes": {
            "rows": {"flops": 2e7, "hbm_bytes": 6e5, "v6e_estimate_s": 8e-7},
            "streamed": {"flops": 8e10, "hbm_bytes": 3e8}}}]}
    points = figures.roofline_points(forward, attention, label_gather)
    assert [(p["label"], p["kind"]) for p in points] == [
        ("128 tokens", "whole forward"), ("10 items", "attention kernel"),
        ("4096 causal", "attention kernel"), ("rows, 256 rows", "label gather")]
    assert points[0]["flops"] / points[0]["s"] == 2e14
    (run,) = figures.roofline_points({"runs": [{"model": "Qwen3-0.6B", "bucket": 2048,
                                                 "flops": 2e12, "hbm_bytes": 2.5e9,
                                                 "seconds": 7e-3}]}, None)
    assert (run["label"], run["kind"], run["s"]) == ("2048 tokens", "whole forward", 7e-3)
    recorded = sorted(glob.glob(str(pathlib.Path(__file__).parent.parent / "docs" / "figures"
                                    / "data" / "compare_*.json")))
    assert len(recorded) == 4
    series = {}
    for path in recorded:
        with open(path) as f:
            result = json.load(f)
        ratios = figures.speedups(result)
        assert len(ratios) == 9 and all(r > 1 for r in ratios.values())
        series[figures.series_label(result, path)] = ratios
    figures.draw_roofline(points, "test", str(tmp_path / "roofline.png"))
    figures.draw_against_hf(series, str(tmp_path / "hf.png"))
    for name in ("roofline.png", "hf.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
