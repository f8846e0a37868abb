"""A small keep-alive HTTP/1.1 client on asyncio streams, for the benchmark client."""
import asyncio
import dataclasses
import json
import re
import urllib.parse

_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


@dataclasses.dataclass
class Answer:
    status: int   # 0: the connection failed
    body: bytes


class ConnectionPool:
    """Connections to one server, each reused by one request at a time."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url must be http://host[:port], got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, method: str, path: str, payload=None) -> Answer:
        """`payload`: JSON-able, or the body's bytes."""
        body = (b"" if payload is None else payload if isinstance(payload, bytes)
                else json.dumps(payload).encode())
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        conn = self._idle.pop() if self._idle else await asyncio.open_connection(
            self.host, self.port, limit=1 << 20)
        try:
            answer, keep_alive = await _exchange(*conn, head.encode() + body)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            conn[1].close()
            return Answer(0, b"")
        if keep_alive:
            self._idle.append(conn)
        else:
            conn[1].close()
        return answer

    async def get_json(self, path: str) -> dict:
        return self._json("GET", path, await self.request("GET", path))

    async def post_json(self, path: str, payload=None) -> dict:
        return self._json("POST", path, await self.request("POST", path, payload))

    @staticmethod
    def _json(method: str, path: str, answer: Answer) -> dict:
        if answer.status != 200:
            raise RuntimeError(f"{method} {path} answered {answer.status}: {answer.body[:200]!r}")
        return json.loads(answer.body)

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def server_vocab(url: str) -> int:
    """The vocabulary size of the model a server at `url` serves."""
    pool = ConnectionPool(url)
    vocab = (await pool.get_json("/get_model_info"))["vocab_size"]
    pool.close()
    return vocab


async def _exchange(reader, writer, data: bytes) -> tuple[Answer, bool]:
    writer.write(data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    match = _LENGTH.search(head)
    body = await reader.readexactly(int(match.group(1))) if match else b""
    return Answer(status, body), b"connection: close" not in head.lower()
