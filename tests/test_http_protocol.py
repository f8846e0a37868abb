"""HTTP/1.1 framing over raw sockets: malformed input, chunked bodies, Expect, pipelining,
HEAD, and the per-connection limits."""
import asyncio
import json
import re
import select
import socket
import threading
import time

import pytest

from runtime.errors import STATUSES
from server.app import ServerConfig
from server.http import Limits, ReadDeadlines, ReadTimeout
from tests.assertions import assert_scores_close
from tests.server_harness import (
    OK,
    call,
    chunked,
    exchange_keep_open,
    json_of,
    metric,
    post,
    raw_exchange,
    recv_until_closed,
    serving,
    serving_server,
    wait_for,
)


@pytest.fixture(scope="module")
def port(engines):
    with serving(engines["llama"], ServerConfig(limits=Limits(max_body_bytes=1 << 16))) as p:
        yield p


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"  HTTP/1.1\r\n\r\n",
    b"GET health HTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked"
    b"\r\n\r\n0\r\n\r\n",
                                  b"POST /v1/score HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                                  # a digit to str.isdigit, not to int(): found by the long fuzz
                                  b"A / HTTP/1.0\r\nContent-Length:\xb2\r\n\r\n",
                                  b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n"])
def test_malformed_http_gets_400_and_server_survives(port, data):
    assert raw_exchange(port, data).startswith(b"HTTP/1.1 400 ")
    assert call(port, "GET", "/health")[0] == 200


def test_chunked_body_scores_like_content_length(port):
    body = json.dumps(OK).encode()
    plain, chunk = exchange_keep_open(port, post(body) + chunked(body), 2)
    assert plain.startswith(b"HTTP/1.1 200 ") and chunk.startswith(b"HTTP/1.1 200 ")
    plain, chunk = json_of(plain), json_of(chunk)
    assert plain["usage"] == chunk["usage"]
    assert_scores_close(chunk["scores"], plain["scores"])  # the second reads the cached query


@pytest.mark.parametrize("data, status", [
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdeXX0\r\n\r\n", 400),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10001\r\n", 413),
    (b"POST /v1/score HTTP/1.1\r\nExpect: magic\r\nContent-Length: 2\r\n\r\n{}", 417)])
def test_bad_transfer_codings_get_errors(port, data, status):
    answer = raw_exchange(port, data)
    assert answer.startswith(b"HTTP/1.1 %d " % status)
    assert json_of(answer)["type"] == STATUSES[status][1] != "Error"
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


TIGHT = Limits(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=1.0, send_timeout_s=0.5)


@pytest.fixture(scope="module")
def tight_server(engines):
    with serving_server(engines["llama"], ServerConfig(limits=TIGHT, max_connections=4)) as s:
        yield s


def open_connections(port) -> int:
    return int(metric(port, "jax_score_open_connections")) - 1  # less the one asking


def trickle(port, burst: bytes, slow: bytes, pause_s: float) -> tuple[bytes, float]:
    """Sends `burst`, then `slow` a byte at a time until answered; (the answer, when it came)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(burst)
        for byte in slow:
            s.sendall(bytes([byte]))
            time.sleep(pause_s)
            if select.select([s], [], [], 0)[0]:
                break
        answered = time.monotonic() - start
        return recv_until_closed(s), answered


@pytest.mark.parametrize("burst, slow, what", [
    (b"GET /health HTTP/1.1\r\n", b"Host: x\r\nX-Slow: " + b"y" * 100, b"request head"),
    (b"POST /v1/score HTTP/1.1\r\nContent-Length: 200\r\n\r\n", b"{" + b" " * 100,
     b"request body"),
    (b"POST /v1/score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n" * 20,
     b"request body")])
def test_slow_clients_are_cut_off_with_408_while_others_are_served(tight_server, burst, slow,
                                                                   what):
    _, port = tight_server
    result = {}
    slow_client = threading.Thread(
        target=lambda: result.update(answer=trickle(port, burst, slow, 0.02)))
    slow_client.start()
    served = [call(port, "GET", "/health")[0] for _ in range(5)]
    slow_client.join(30)
    answer, seconds = result["answer"]
    assert served == [200] * 5
    assert answer.startswith(b"HTTP/1.1 408 ") and what in answer, answer[:200]
    assert b"Connection: close" in answer
    assert 0.5 <= seconds < len(slow) * 0.02  # cut off at the timeout, before it finished


def test_read_deadlines_fail_only_the_reads_past_their_limit():
    """One timer for every connection's read limits: a read past its limit raises ReadTimeout
    within a sweep period of it, a limit cleared in time never fires, and with no limit set
    no timer is left running."""
    assert Limits().sweep_s == 1.0 and TIGHT.sweep_s == 0.05

    async def scenario():
        loop, deadlines = asyncio.get_running_loop(), ReadDeadlines(0.01)
        slow, quick = asyncio.StreamReader(), asyncio.StreamReader()
        start = loop.time()
        deadlines.set(slow, 0.05, "request head")
        deadlines.set(quick, 0.05, "request body")
        quick.feed_data(b"x")
        assert await quick.readexactly(1) == b"x"
        deadlines.clear(quick)
        with pytest.raises(ReadTimeout, match="request head not received within 0.05 s"):
            await slow.readexactly(1)
        waited = loop.time() - start
        await asyncio.sleep(0.1)  # past quick's limit, had it stayed
        quick.feed_data(b"y")
        assert await quick.readexactly(1) == b"y"
        return waited, len(asyncio.all_tasks())

    waited, tasks = asyncio.run(scenario())
    assert 0.05 <= waited < 0.5, waited
    assert tasks == 1  # the scenario's own: the sweep stopped with no limit left


def test_idle_keep_alive_connections_are_closed_quietly(tight_server):
    _, port = tight_server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        start = time.monotonic()
        assert recv_until_closed(s) == b""  # never sent a byte: no answer, just closed
        assert 0.9 < time.monotonic() - start < 5
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        answer = recv_until_closed(s)  # answered, kept alive, then closed when idle
        assert answer.startswith(b"HTTP/1.1 200 ") and b"Connection: keep-alive" in answer
    assert wait_for(lambda: open_connections(port) == 0)


def test_connections_beyond_the_limit_get_503_with_retry_after(tight_server):
    _, port = tight_server
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        refused = raw_exchange(port, b"GET /health HTTP/1.1\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1\r\n" in refused
        assert b"Connection: close" in refused and b"too many open connections" in refused
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: call(port, "GET", "/health")[0] == 200)


def test_a_client_that_does_not_read_its_responses_is_cut_off(tight_server):
    _, port = tight_server
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.settimeout(0.2)
    request = b"GET /get_model_info HTTP/1.1\r\n\r\n"
    try:
        for _ in range(200000):  # pipelined, never read, until the server stops reading
            s.sendall(request)
    except (TimeoutError, ConnectionError):
        pass
    try:
        assert wait_for(lambda: open_connections(port) == 0)
        assert call(port, "GET", "/health")[0] == 200
    finally:
        s.close()


def test_a_refused_body_still_being_sent_gets_its_413(port):
    body = b"x" * (4 << 20)  # more than the socket buffers hold: still sending when refused
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/score HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert recv_until_closed(s).startswith(b"HTTP/1.1 413 ")  # not a connection reset


def test_absolute_form_targets_and_query_strings_route_by_path(port):
    for target in (b"http://localhost/health", b"/health?verbose=1", b"http://h:1/health?x"):
        answer = raw_exchange(port, b"GET %s HTTP/1.1\r\nConnection: close\r\n\r\n" % target)
        assert answer.startswith(b"HTTP/1.1 200 ") and json_of(answer) == {"status": "ok"}


def test_a_request_head_over_the_limit_gets_431(engines):
    with serving(engines["llama"], ServerConfig(limits=Limits(max_head_bytes=1024))) as p:
        big = b"GET /health HTTP/1.1\r\nX-Big: " + b"y" * 2000 + b"\r\n\r\n"
        answer = raw_exchange(p, big)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"request head too large" in answer
        assert json_of(answer)["type"] == "RequestHeaderFieldsTooLarge"
        fits = b"GET /health HTTP/1.1\r\nX-Big: " + b"y" * 900 + b"\r\n\r\n"
        assert raw_exchange(p, fits + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
                            ).startswith(b"HTTP/1.1 200 ")
