"""A server's life under load: clients that vanish, saturation, many clients, shutdown."""
import http.client
import json
import socket
import threading
import time

import pytest

from runtime.engine import Engine
from server.app import ServerConfig
from tests.assertions import assert_no_leaked_pages, assert_scores_close
from tests.gated_runner import GatedRunner
from tests.server_harness import OK, assert_error, call, metric, serving, wait_for
from tests.tiny_models import small_config


def test_a_client_that_disconnects_has_its_request_dropped(model_dirs, monkeypatch):
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


def test_shutdown_finishes_the_requests_in_flight(model_dirs, monkeypatch):
    """In flight: a request being answered; one on a connection the kernel has queued and the
    server not yet taken (closing the listener would reset it); the first request of a
    connection taken just before, sent once the others are answered."""
    import asyncio

    from server.app import FIRST_REQUEST_WAIT_S, ScoreServer
    engine = Engine.from_path(model_dirs["llama"], small_config())
    engine.score(**OK)  # compiled: the gated forward then ends soon after its release
    gate = GatedRunner(engine.runner, monkeypatch)
    server = ScoreServer(engine)
    body = json.dumps(OK).encode()
    request = b"POST /v1/score HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def scenario():
        listener = await server.start("127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        reply = loop.run_in_executor(None, call, port, "POST", "/v1/score", OK)
        assert await loop.run_in_executor(None, gate.entered.wait, 60)
        taken = socket.create_connection(("127.0.0.1", port), timeout=30)
        await asyncio.sleep(0.2)  # the server takes the connection; no request on it yet
        queued = socket.create_connection(("127.0.0.1", port), timeout=30)
        queued.sendall(request)   # the event loop has not run since: still in the kernel's queue
        loop.call_later(0.3, gate.release.set)
        reply.add_done_callback(  # once the first request is answered
            lambda _: loop.call_later(FIRST_REQUEST_WAIT_S / 4, taken.sendall, request))
        await server.shutdown(listener, grace_s=30)  # what SIGTERM does
        status, payload, headers = await reply
        assert status == 200 and len(payload["scores"]) == 2
        assert headers["Connection"] == "close"
        for conn in (queued, taken):
            with conn:
                answer = b"".join(iter(lambda: conn.recv(65536), b""))
            assert answer.startswith(b"HTTP/1.1 200 ") and b"\r\nConnection: close\r\n" in answer
            assert len(json.loads(answer.split(b"\r\n\r\n", 1)[1])["scores"]) == 2
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)

    asyncio.run(scenario())
    assert_no_leaked_pages(engine)
    engine.close()


def test_beyond_the_queue_limit_requests_get_503_with_retry_after(model_dirs, monkeypatch):
    engine = Engine.from_path(model_dirs["llama"], small_config())
    gate = GatedRunner(engine.runner, monkeypatch)
    replies = []
    with serving(engine, ServerConfig(max_pending=3)) as p:
        queued = [threading.Thread(target=lambda: replies.append(call(p, "POST", "/v1/score", OK)))
                  for _ in range(3)]
        for worker in queued:
            worker.start()
        assert wait_for(lambda: metric(p, "jax_score_pending_requests") == "3")
        for _ in range(5):
            status, payload, headers = call(p, "POST", "/v1/score", OK)
            assert_error(status, payload, 503, "saturated")
            assert headers["Retry-After"] == "1"
        assert call(p, "GET", "/health")[0] == 200
        gate.release.set()
        for worker in queued:
            worker.join(60)
        assert call(p, "POST", "/v1/score", OK)[0] == 200  # the queue drained
    assert [status for status, _, _ in replies] == [200] * 3
    assert_no_leaked_pages(engine)
    engine.close()


def client_requests(client: int) -> list[dict]:
    return [{"query": f"Query {client % 8} about cities", "label_token_ids": [5, 17, 40],
             "items": [f" item {client}-{r}-{k}" for k in range(1 + (client + r) % 4)],
             "apply_softmax": r % 2 == 0} for r in range(3)]


def test_64_keep_alive_clients_at_once(engines):
    engine, clients = engines["llama"], 64
    answers, errors = {}, []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            for r, body in enumerate(client_requests(i)):
                status, payload, _ = call(port, "POST", "/v1/score", body, conn=conn)
                answers[i, r] = payload
                if status != 200:
                    errors.append((status, payload))
        except Exception as e:  # noqa: BLE001 - any failure is reported by the assert below
            errors.append(repr(e))
        finally:
            conn.close()

    with serving(engine) as port:
        workers = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(300)
        assert not errors and len(answers) == 3 * clients
        assert wait_for(lambda: metric(port, "jax_score_open_connections") == "1")  # the asker
    for i in range(clients):
        for r, body in enumerate(client_requests(i)):
            assert_scores_close(answers[i, r]["scores"], engine.score(**body).scores)
    assert_no_leaked_pages(engine)
