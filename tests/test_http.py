"""The HTTP contract of SPEC §2 over a real socket."""
import json
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest

from server.app import ServerConfig
from tests.server_harness import call, serving

OK = {"query": "Tokyo is a city", "items": [" in Japan", " in France"],
      "label_token_ids": [5, 17]}


@pytest.fixture(scope="module")
def port(engines):
    with serving(engines["llama"], ServerConfig(max_body_bytes=1 << 16)) as p:
        yield p


def assert_error(status, payload, code, fragment=""):
    assert status == code, payload
    assert set(payload) == {"object", "message", "type", "param", "code"}
    assert payload["object"] == "error" and payload["code"] == code and payload["param"] is None
    assert fragment.lower() in payload["message"].lower(), payload["message"]


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
    ({"query": "q", "items": ["a"], "label_token_ids": [320]}, "token id 320"),
    ({"query": "q", "items": ["a"], "label_token_ids": [10**30]}, f"token id {10**30}"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "both be text or both"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "both be text or both"),
    ({"query": [1, 999], "items": [[1]], "label_token_ids": [1]}, "token id 999"),
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
    assert payload["model"] == "my-model" and payload["object"] == "scoring"
    np.testing.assert_allclose(payload["scores"], direct.scores, rtol=1e-6)
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
    np.testing.assert_allclose(payload["scores"],
                               engines["llama"].score(**body).scores, rtol=1e-6)
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
    _, info, _ = call(port, "GET", "/get_model_info")
    assert info["is_generation"] is True and info["vocab_size"] == 320


def test_compilations_are_reported_in_info_and_metrics(port, engines):
    import http.client
    assert call(port, "POST", "/v1/score", OK)[0] == 200
    _, info, _ = call(port, "GET", "/get_model_info")
    assert info["compilations"] == engines["llama"].runner.compile_count > 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    lines = resp.read().decode().splitlines()
    conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    assert f"jax_score_compilations_total {info['compilations']}" in lines
    assert "# TYPE jax_score_kv_pages_free gauge" in lines


def raw_exchange(port, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("data", [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                                  b"POST /v1/score HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                                  b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n"])
def test_malformed_http_gets_400_and_server_survives(port, data):
    assert raw_exchange(port, data).startswith(b"HTTP/1.1 400 ")
    assert call(port, "GET", "/health")[0] == 200


def test_engine_bug_is_500_and_only_that_request_fails(engines, monkeypatch):
    def broken(req):
        raise RuntimeError("injected failure")
    with serving(engines["llama"]) as p:
        monkeypatch.setattr(engines["llama"], "submit", broken)
        assert_error(*call(p, "POST", "/v1/score", OK)[:2], 500, "injected failure")
        monkeypatch.undo()
        assert call(p, "POST", "/v1/score", OK)[0] == 200


def test_saturated_server_answers_503(engines):
    with serving(engines["llama"], ServerConfig(max_pending=0)) as p:
        assert_error(*call(p, "POST", "/v1/score", OK)[:2], 503, "saturated")
        assert call(p, "GET", "/health")[0] == 200


def test_health_answers_during_a_forward(engines, monkeypatch):
    engine = engines["llama"]
    real = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda *a: (time.sleep(2.0), real(*a))[1])
    with serving(engine) as p:
        worker = threading.Thread(target=call, args=(p, "POST", "/v1/score", OK))
        worker.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert call(p, "GET", "/health")[0] == 200
        assert time.monotonic() - start < 1.0
        worker.join(30)


def test_cli_serves_a_checkpoint_with_sglang_flag_spelling(model_dirs):
    import re
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model-path", model_dirs["qwen3"],
                             "--port", "0", "--dtype=float32", "--max-prefill-tokens", "64",
                             "--max-seqs=4", "--max-rows=16", "--disable-prefix-cache"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if match := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                break
        else:
            raise AssertionError("server did not report its port")
        port = int(match.group(1))
        assert call(port, "GET", "/health")[0] == 200
        status, payload, _ = call(port, "POST", "/v1/score", {**OK, "item_first": True})
        assert status == 200 and len(payload["scores"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # a graceful stop
    finally:
        proc.kill()
        proc.wait(30)


def test_a_client_that_disconnects_has_its_request_dropped(model_dirs, monkeypatch):
    from runtime.engine import Engine
    from tests.assertions import assert_no_leaked_pages
    from tests.conftest import small_config
    from tests.gated_runner import GatedRunner
    engine = Engine.from_path(model_dirs["llama"], small_config())
    gate = GatedRunner(engine.runner, monkeypatch)
    with serving(engine, ServerConfig(gone_poll_s=0.02)) as p:
        busy = threading.Thread(target=call, args=(p, "POST", "/v1/score", OK))
        busy.start()
        assert gate.entered.wait(60)  # the first request holds the scheduler
        body = json.dumps({**OK, "items": ["x"] * 5}).encode()
        with socket.create_connection(("127.0.0.1", p), timeout=30) as s:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            deadline = time.monotonic() + 30
            while engine.scheduler.waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.scheduler.waiting == 1  # queued behind the first
        time.sleep(0.5)  # many polls: the server has seen the client go
        gate.release.set()
        busy.join(60)
        assert call(p, "GET", "/health")[0] == 200
    assert gate.rows == [len(OK["items"])]  # the dropped request's 5 items never ran
    assert_no_leaked_pages(engine)
    engine.close()


def exchange_keep_open(port, data: bytes, responses: int) -> list[bytes]:
    """Sends `data`, reads `responses` complete responses (Content-Length framed)."""
    out, buf = [], b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        while len(out) < responses:
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1)) if (
                b"Content-Length" in head) else 0
            while len(buf) < length:
                buf += s.recv(65536)
            out.append(head + b"\r\n\r\n" + buf[:length])
            buf = buf[length:]
    return out


def post(body: bytes, headers: str = "") -> bytes:
    return (b"POST /v1/score HTTP/1.1\r\nHost: x\r\n" + headers.encode()
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def chunked(body: bytes, headers: str = "", sizes=(7, 1, 50)) -> bytes:
    parts, rest = [], body
    for n in sizes:
        parts.append(b"%x;ext=1\r\n%s\r\n" % (len(rest[:n]), rest[:n]))
        rest = rest[n:]
    parts.append(b"%X\r\n%s\r\n" % (len(rest), rest) if rest else b"")
    return (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            + headers.encode() + b"\r\n" + b"".join(parts) + b"0\r\nX-Trailer: y\r\n\r\n")


def json_of(response: bytes):
    return json.loads(response.partition(b"\r\n\r\n")[2])


def test_chunked_body_scores_like_content_length(port):
    body = json.dumps(OK).encode()
    plain, chunk = exchange_keep_open(port, post(body) + chunked(body), 2)
    assert plain.startswith(b"HTTP/1.1 200 ") and chunk.startswith(b"HTTP/1.1 200 ")
    assert json_of(plain)["scores"] == json_of(chunk)["scores"]


@pytest.mark.parametrize("data, status", [
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdeXX0\r\n\r\n", 400),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10001\r\n", 413),
    (b"POST /v1/score HTTP/1.1\r\nExpect: magic\r\nContent-Length: 2\r\n\r\n{}", 417)])
def test_bad_transfer_codings_get_errors(port, data, status):
    assert raw_exchange(port, data).startswith(b"HTTP/1.1 %d " % status)
    assert call(port, "GET", "/health")[0] == 200


def test_expect_100_continue_is_answered_before_the_body(port):
    body = json.dumps(OK).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/score HTTP/1.1\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_pipelined_requests_are_answered_in_order(port):
    first = json.dumps({**OK, "items": ["a"]}).encode()
    second = json.dumps({**OK, "items": ["b", "c", "d"]}).encode()
    health = b"GET /health HTTP/1.1\r\n\r\n"
    responses = exchange_keep_open(port, post(first) + health + post(second), 3)
    assert [len(json_of(r).get("scores", [])) for r in responses] == [1, 0, 3]
    assert json_of(responses[1]) == {"status": "ok"}


def test_head_on_get_routes_sends_headers_only(port):
    get, = exchange_keep_open(port, b"GET /health HTTP/1.1\r\n\r\n", 1)
    head = raw_exchange(port, b"HEAD /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # no body
    length = re.search(rb"Content-Length: (\d+)", get).group(1)
    assert b"Content-Length: " + length in head  # the GET body's length
    refused = raw_exchange(port, b"HEAD /v1/score HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 405 ") and b"Allow: POST\r\n" in refused


def test_shutdown_finishes_the_requests_in_flight(model_dirs, monkeypatch):
    import asyncio

    from runtime.engine import Engine
    from server.app import ScoreServer
    from tests.assertions import assert_no_leaked_pages
    from tests.conftest import small_config
    from tests.gated_runner import GatedRunner
    engine = Engine.from_path(model_dirs["llama"], small_config())
    gate = GatedRunner(engine.runner, monkeypatch)
    server = ScoreServer(engine)

    async def scenario():
        listener = await server.start("127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        reply = loop.run_in_executor(None, call, port, "POST", "/v1/score", OK)
        assert await loop.run_in_executor(None, gate.entered.wait, 60)
        listener.close()  # what SIGTERM does first
        loop.call_later(0.3, gate.release.set)
        await server.shutdown(grace_s=30)
        status, payload, headers = await reply
        assert status == 200 and len(payload["scores"]) == 2
        assert headers["Connection"] == "close"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)

    asyncio.run(scenario())
    assert_no_leaked_pages(engine)
    engine.close()
