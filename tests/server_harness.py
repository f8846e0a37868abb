"""Runs a ScoreServer on an ephemeral loopback port in a background event loop, and talks to
it: through http.client, or as raw bytes on a socket."""
import asyncio
import contextlib
import http.client
import json
import re
import socket
import threading
import time

from server.app import ScoreServer, ServerConfig

OK = {"query": "Tokyo is a city", "items": [" in Japan", " in France"],
      "label_token_ids": [5, 17]}


@contextlib.contextmanager
def serving(engine, config: ServerConfig = ServerConfig()):
    """Yields the port."""
    with serving_server(engine, config) as (_, port):
        yield port


@contextlib.contextmanager
def serving_server(engine, config: ServerConfig = ServerConfig()):
    """Yields (the ScoreServer, its port)."""
    loop = asyncio.new_event_loop()
    server = ScoreServer(engine, config)
    listener = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server, listener.sockets[0].getsockname()[1]
    finally:
        asyncio.run_coroutine_threadsafe(_shutdown(listener), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _shutdown(listener) -> None:
    listener.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def call(port: int, method: str, path: str, body=None, headers=None, conn=None):
    """(status, parsed JSON body, response headers); `body` may be raw bytes or JSON-able."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    if own:
        conn.close()
    return resp.status, payload, dict(resp.getheaders())


def assert_error(status, payload, code, fragment=""):
    assert status == code, payload
    assert set(payload) == {"object", "message", "type", "param", "code"}
    assert payload["object"] == "error" and payload["code"] == code and payload["param"] is None
    assert fragment.lower() in payload["message"].lower(), payload["message"]


def raw_exchange(port, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        return recv_until_closed(s)


def recv_until_closed(s: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def metrics_lines(port: int) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    lines = resp.read().decode().splitlines()
    conn.close()
    return lines


def metric(port: int, name: str) -> str:
    """The value of an unlabelled metric in /metrics."""
    return next(line.split(" ")[1] for line in metrics_lines(port) if line.startswith(name + " "))


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
