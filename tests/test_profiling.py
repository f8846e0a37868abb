import json
import subprocess
import sys

import pytest

from profiling.bench_engine import run, workload


def test_bench_engine_measures_every_mode(model_dirs, engines):
    from runtime.engine import Engine
    from tests.conftest import small_config
    uncached = Engine.from_path(model_dirs["qwen3"], small_config(prefix_cache=False))
    reqs = workload(320, query_tokens=12, item_tokens=3, num_items=4, num_labels=2, requests=4,
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
                 heads=Heads(q=2, kv=1, dim=64, page=16), q_block=64, kv_block=64)
    small, large = result["shapes"]["mis_120q_10x18"], result["shapes"]["mis_120q_64x18"]
    assert large["kv_blocks_visited"] < large["kv_blocks_dense_causal"]
    assert small["flops"] == 4 * small["kv_blocks_visited"] * 2 * 64 * 64 * 64
    for row in (small, large):
        assert row["measured_s"] > 0 and row["v6e_roofline_s"] > 0


def test_bench_label_gather_reports_bytes_roofline_and_time():
    from profiling.bench_label_gather import run
    result = run([1, 16], vocab=3000, hidden=64, labels=2, repeats=1)
    for rows, row in result["rows"].items():
        b = row["hbm_bytes"]
        assert b["labels_only"] < b["streamed_logsumexp"] < b["full_logits_baseline"]
        assert b["full_logits_baseline"] - b["streamed_logsumexp"] >= 2 * rows * 3000 * 4 - 4 * rows * 3
        assert all(t > 0 for t in row["measured_s"].values())


def test_op_time_reads_named_ops_from_a_profiler_trace(tmp_path):
    import jax
    import jax.numpy as jnp

    from profiling.timing import op_time
    fn = jax.jit(lambda x: jnp.sin(x @ x).sum())
    x = jnp.ones((256, 256))
    seconds = op_time(fn, (x,), "sine", repeats=2, trace_dir=str(tmp_path))
    assert seconds is not None and 0 < seconds < 10
    assert list(tmp_path.rglob("*.xplane.pb"))  # a trace TensorBoard can open
    assert op_time(fn, (x,), "no_such_kernel", repeats=1) is None


def test_bench_score_drives_a_server_and_reports_latency(engines):
    import asyncio

    from profiling.bench_score import run
    from tests.server_harness import metric, serving
    with serving(engines["llama"]) as port:
        before = int(metric(port, "jax_score_items_scored_total"))
        result = asyncio.run(run(f"http://127.0.0.1:{port}", qps=20, duration=1.5, num_items=3,
                                 query_tokens=10, item_tokens=2, num_labels=2, concurrency=4,
                                 distinct_queries=2))
        scored = int(metric(port, "jax_score_items_scored_total")) - before
    assert result["requests"] > 10 and result["ok"] == result["requests"]
    assert result["errors"] == 0 and scored == 3 * result["ok"]
    lat = result["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert result["items_per_s"] == pytest.approx(3 * result["req_per_s"])


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
