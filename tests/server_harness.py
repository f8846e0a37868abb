"""Runs a ScoreServer on an ephemeral loopback port in a background event loop."""
import asyncio
import contextlib
import http.client
import json
import threading

from server.app import ScoreServer, ServerConfig


@contextlib.contextmanager
def serving(engine, config: ServerConfig = ServerConfig()):
    loop = asyncio.new_event_loop()
    server = ScoreServer(engine, config)
    listener = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield listener.sockets[0].getsockname()[1]
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
