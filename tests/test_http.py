"""The HTTP contract of CONTRACT §2 over a real socket: routes, bodies, errors, the CLI."""
import re
import signal
import threading
import time

import numpy as np
import pytest

from server.app import ServerConfig
from server.http import Limits
from tests.assertions import assert_scores_close
from tests.server_harness import OK, assert_error, call, metrics_lines, serving
from tests.tiny_models import VOCAB


@pytest.fixture(scope="module")
def port(engines):
    with serving(engines["llama"], ServerConfig(model_name="tiny-llama", model_path="/m/tiny",
                                                limits=Limits(max_body_bytes=1 << 16))) as p:
        yield p


BAD_BODIES = [
    (b"{", "invalid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"query": NaN, "items": [], "label_token_ids": [1]}', "NaN"),
    (b'\xff\xfe{"query": 1}', "UTF-8"),
    (b"[" * 20000 + b"]" * 20000, "nested"),
    ({"items": ["a"], "label_token_ids": [1]}, "'query'"),
    ({"query": "q", "label_token_ids": [1]}, "'items'"),
    ({"query": "q", "items": ["a"]}, "'label_token_ids'"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "must not be empty"),
    ({"query": 5, "items": ["a"], "label_token_ids": [1]}, "query must be"),
    ({"query": "q", "items": 5, "label_token_ids": [1]}, "items must be"),
    ({"query": "q", "items": ["a", [1]], "label_token_ids": [1]}, "all strings"),
    ({"query": [1, 2], "items": [1, 2], "label_token_ids": [1]}, "items must be"),
    ({"query": "q", "items": ["a"], "label_token_ids": "1"}, "label_token_ids must be"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1.5]}, "label_token_ids must be"),
    ({"query": "q", "items": ["a"], "label_token_ids": [True]}, "label_token_ids must be"),
    ({"query": "q", "items": ["a"], "label_token_ids": [-1]}, "token id -1"),
    ({"query": "q", "items": ["a"], "label_token_ids": [VOCAB]}, f"token id {VOCAB}"),
    ({"query": "q", "items": ["a"], "label_token_ids": [10**30]}, f"token id {10**30}"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "both be text or both"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "both be text or both"),
    ({"query": [1, 999], "items": [[1]], "label_token_ids": [1]}, "token id 999"),
    ({"query": [1, 2], "items": [[1], [2, -3]], "label_token_ids": [1]},
     "items[1] contains token id -3"),
    ({"query": [1], "items": [[], [10**30]], "label_token_ids": [1]},
     f"items[1] contains token id {10**30}"),
    ({"query": [1], "items": [[2, 10**30]], "label_token_ids": [1], "item_first": True},
     f"items[0] contains token id {10**30}"),
    ({"query": [1, -7], "items": [], "label_token_ids": [1]}, "query contains token id -7"),
    ({"query": [1] * 250, "items": [[2] * 10], "label_token_ids": [1]}, "more than the maximum"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"}, "boolean"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "item_first": 1}, "boolean"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "model": 3}, "model"),
    ({"query": [], "items": [[]], "label_token_ids": [1]}, "empty"),
]


@pytest.mark.parametrize("body, fragment", BAD_BODIES)
def test_bad_requests_get_400(port, body, fragment):
    status, payload, _ = call(port, "POST", "/v1/score", body)
    assert_error(status, payload, 400, fragment)


def test_routes_and_methods(port):
    assert_error(*call(port, "GET", "/v2/nothing")[:2], 404)
    status, payload, headers = call(port, "GET", "/v1/score")
    assert_error(status, payload, 405)
    assert headers["Allow"] == "POST"
    assert_error(*call(port, "POST", "/health")[:2], 405)


def test_body_too_large_gets_413(port):
    assert_error(*call(port, "POST", "/v1/score", b"x" * (1 << 17))[:2], 413)
    assert call(port, "GET", "/health")[0] == 200


def test_score_response_shape_and_usage(port, engines):
    status, payload, _ = call(port, "POST", "/v1/score", {**OK, "model": "my-model"})
    assert status == 200
    direct = engines["llama"].score(OK["query"], OK["items"], OK["label_token_ids"])
    assert payload["model"] == "tiny-llama" and payload["object"] == "scoring"
    assert_scores_close(payload["scores"], direct.scores)  # direct: query KV from the cache
    n = direct.prompt_tokens
    assert n == len(engines["llama"].tokenizer.encode(OK["query"])) + 1 + sum(
        len(engines["llama"].tokenizer.encode(i)) for i in OK["items"])
    assert payload["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}


def test_apply_softmax_both_ways(port):
    _, soft, _ = call(port, "POST", "/v1/score", {**OK, "apply_softmax": True})
    _, raw, _ = call(port, "POST", "/v1/score", {**OK, "apply_softmax": False})
    np.testing.assert_allclose(np.sum(soft["scores"], axis=1), 1.0, atol=1e-9)
    raw = np.array(raw["scores"])
    assert ((raw > 0) & (raw < 1)).all() and (raw.sum(axis=1) < 1).all()
    np.testing.assert_allclose(raw / raw.sum(axis=1, keepdims=True), soft["scores"], rtol=1e-5)


def test_empty_items_and_single_string_item(port):
    status, payload, _ = call(port, "POST", "/v1/score", {**OK, "items": []})
    assert status == 200 and payload["scores"] == [] and payload["usage"]["prompt_tokens"] == 0
    status, payload, _ = call(port, "POST", "/v1/score", {**OK, "items": " in Japan"})
    assert status == 200 and len(payload["scores"]) == 1


def test_unicode_text_and_token_ids(port, engines):
    body = {"query": "héllo wörld, 世界", "items": ["🙂", "", "Ünï"], "label_token_ids": [3]}
    status, payload, _ = call(port, "POST", "/v1/score", body)
    assert status == 200
    assert_scores_close(payload["scores"], engines["llama"].score(**body).scores)
    status, payload, _ = call(port, "POST", "/v1/score",
                              {"query": [4, 5, 6], "items": [[7], [8, 9]], "label_token_ids": [1]})
    assert status == 200 and payload["usage"]["prompt_tokens"] == 6


def test_keep_alive_reuses_the_connection(port):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    assert call(port, "GET", "/health", conn=conn)[0] == 200
    sock = conn.sock
    assert call(port, "POST", "/v1/score", OK, conn=conn)[0] == 200
    assert_error(*call(port, "POST", "/v1/score", b"{", conn=conn)[:2], 400)
    assert call(port, "GET", "/v1/models", conn=conn)[0] == 200
    assert conn.sock is sock
    conn.close()


def test_info_endpoints(port):
    assert call(port, "GET", "/health")[:2] == (200, {"status": "ok"})
    _, models, _ = call(port, "GET", "/v1/models")
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["id"] == "tiny-llama"  # the served name, as every response's
    _, info, _ = call(port, "GET", "/get_model_info")
    assert info["is_generation"] is True and info["vocab_size"] == VOCAB
    assert info["model_path"] == "/m/tiny" and info["quantization"] == "none"


def test_compilations_are_reported_in_info_and_metrics(port, engines):
    assert call(port, "POST", "/v1/score", OK)[0] == 200
    _, info, _ = call(port, "GET", "/get_model_info")
    assert info["compilations"] == engines["llama"].runner.compile_count > 0
    lines = metrics_lines(port)
    assert f"jax_score_compilations_total {info['compilations']}" in lines
    assert "# TYPE jax_score_kv_pages_used gauge" in lines
    for timed in ("forward_in_flight", "scheduler_host"):  # a forward ran: both took time
        line = next(x for x in lines if x.startswith(f"jax_score_{timed}_seconds_total "))
        assert float(line.split()[1]) > 0


def test_metrics_count_requests_items_and_latency(engines, access_log):
    with serving(engines["llama"]) as p:
        for items in (["a"], ["b", "c"], ["d", "e", "f"]):
            assert call(p, "POST", "/v1/score", {**OK, "items": items})[0] == 200
        assert call(p, "POST", "/v1/score", b"{")[0] == 400
        assert call(p, "GET", "/nowhere")[0] == 404
        assert call(p, "GET", "/health")[0] == 200
        lines = metrics_lines(p)
    requests = "jax_score_http_requests_total"
    for route, status, n in [("/v1/score", 200, 3), ("/v1/score", 400, 1), ("other", 404, 1),
                             ("/health", 200, 1)]:
        assert f'{requests}{{route="{route}",status="{status}"}} {n}' in lines
    assert "jax_score_items_scored_total 6" in lines
    buckets = [int(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("jax_score_request_duration_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 4  # the 400 is timed too
    assert "jax_score_request_duration_seconds_count 4" in lines
    assert "jax_score_pending_requests 0" in lines
    log = [line for line in access_log.getvalue().splitlines() if "/v1/score" in line]
    assert len(log) == 4 and re.fullmatch(r"I\d{4} [\d:.]+ +\d+ access_log\.py:\d+\] "
                                          r"127\.0\.0\.1:\d+ POST /v1/score 200 items=3 "
                                          r"[\d.]+ms", log[2]), log


def test_engine_bug_is_500_and_only_that_request_fails(engines, monkeypatch):
    def broken(req, pieces=None):
        raise RuntimeError("injected failure")
    with serving(engines["llama"]) as p:
        monkeypatch.setattr(engines["llama"], "submit", broken)
        assert_error(*call(p, "POST", "/v1/score", OK)[:2], 500, "injected failure")
        monkeypatch.undo()
        assert call(p, "POST", "/v1/score", OK)[0] == 200


def test_health_answers_during_a_forward(engines, monkeypatch):
    engine = engines["llama"]
    real = engine.runner.collect
    monkeypatch.setattr(engine.runner, "collect", lambda *a: (time.sleep(2.0), real(*a))[1])
    with serving(engine) as p:
        worker = threading.Thread(target=call, args=(p, "POST", "/v1/score", OK))
        worker.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert call(p, "GET", "/health")[0] == 200
        assert time.monotonic() - start < 1.0
        worker.join(30)


def start_cli_server(model_dir: str, *args: str, env=None):
    """`python -m server` on a free port: (the process, its port, its log lines so far)."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model-path", model_dir,
                             "--port", "0", *args], stderr=subprocess.PIPE, text=True, env=env)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline and (line := proc.stderr.readline()):
        lines.append(line)
        if match := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
            return proc, int(match.group(1)), lines
    proc.kill()
    raise AssertionError("server did not report its port:\n" + "".join(lines))


def test_cli_serves_a_checkpoint_with_sglang_flag_spelling(model_dirs, tmp_path):
    """Also: start-up lines say what serves and which routes are open, the second start reads
    every program back from the program cache, and takes its API key from the environment
    without logging it."""
    import os
    args = ["--dtype=auto", "--max-prefill-tokens", "64", "--max-seqs=4", "--max-rows=16",
            "--disable-prefix-cache", "--compile-cache-dir", str(tmp_path / "xla")]
    key = "cli-key-42"
    for start in ("first", "second"):
        env = {**os.environ, "JAX_SCORE_API_KEY": key} if start == "second" else None
        proc, port, lines = start_cli_server(model_dirs["qwen3"], *args, env=env)
        auth = {"Authorization": f"Bearer {key}"} if env else {}
        try:
            assert re.search(r"serving .*qwen3: qwen3 in float32, xla kernels, 1 replica\(s\)"
                             r" of 1 cpu device\(s\) \(cpu\), KV pool of \d+ tokens a replica,"
                             r" fair scheduling, on http://", lines[-1]), lines[-1]
            assert ("routes open: /health; with the API key: /v1/score" if env else
                    "routes open: /v1/score") in lines[-2], lines[-2]
            ready = next(re.search(r"(\d+) programs ready in \d+ s: (\d+) read from the "
                                   r"program cache, (\d+) compiled", line) for line in lines
                         if "programs ready" in line)
            total, read, compiled = map(int, ready.groups())
            assert (read, compiled) == ((total, 0) if start == "second" else (0, total))
            assert call(port, "GET", "/health")[0] == 200
            assert call(port, "GET", "/get_model_info", headers=auth)[1]["dtype"] == "float32"
            status, payload, _ = call(port, "POST", "/v1/score", {**OK, "item_first": True},
                                      auth)
            assert status == 200 and len(payload["scores"]) == 2
            assert call(port, "POST", "/v1/score", OK)[0] == (401 if env else 200)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0  # a graceful stop
            assert key not in "".join(lines) + proc.stderr.read()
        finally:
            proc.kill()
            proc.wait(30)


def test_cli_refuses_an_argument_that_is_not_a_flag(model_dirs):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "server", "--model-path", model_dirs["qwen3"],
                           "--port", "0", "--max-prefill-tokens", "64", "_q_block", "8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "unexpected arguments ['_q_block', '8']" in proc.stderr


def test_cli_refuses_an_empty_api_key_before_loading_the_model(model_dirs):
    """An unset shell variable passed as the key must not start a server without one."""
    import os
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "server", "--model-path", model_dirs["qwen3"],
                           "--port", "0"], env={**os.environ, "JAX_SCORE_API_KEY": ""},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "$JAX_SCORE_API_KEY: the API key must be non-empty" in proc.stderr
    assert "replicas:" not in proc.stderr  # refused before the engine started


def test_flag_values_that_look_like_flags_pass_unchanged():
    from runtime.cli_flags import _underscored
    assert _underscored("--max-prefill-tokens") == "--max_prefill_tokens"
    assert _underscored("--model-path=/a-b") == "--model_path=/a-b"
    # e.g. the value of bench_compare's --server-args: other flags, for another command line
    assert _underscored("--q-block 512 --kv-block 1024") == "--q-block 512 --kv-block 1024"
