"""Minimal HTTP/1.1 message reading and writing over asyncio streams."""
import asyncio
import dataclasses
import json

from runtime.errors import ScoreError

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable"}


@dataclasses.dataclass
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return conn == "keep-alive"
        return conn != "close"


class HttpError(ScoreError):
    """A protocol-level error: answered, then the connection is closed."""


def _parse_head(head: bytes) -> Request:
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise HttpError("malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise HttpError(f"unsupported HTTP version {version!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return Request(method, target.split("?", 1)[0], version, headers)


def _content_length(req: Request, max_body: int) -> int:
    if "transfer-encoding" in req.headers:
        raise HttpError("Transfer-Encoding request bodies are not supported; send Content-Length",
                        status=501)
    raw = req.headers.get("content-length", "0")
    if not raw.isdigit():
        raise HttpError(f"invalid Content-Length {raw[:40]!r}")
    if int(raw) > max_body:
        raise HttpError(f"body of {raw} bytes exceeds the limit of {max_body}", status=413)
    return int(raw)


async def read_request(reader: asyncio.StreamReader, max_body: int) -> Request | None:
    """The next request on the connection, or None when the client closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise HttpError("connection closed inside the request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise HttpError("request head too large", status=431) from None
    req = _parse_head(head[:-4])
    req.body = await reader.readexactly(_content_length(req, max_body))
    return req


def encode_response(status: int, payload, keep_alive: bool, extra_headers=(),
                    content_type: str = "application/json") -> bytes:
    """`payload`: JSON-able, or bytes sent as they are."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}",
            f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}", *extra_headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def error_body(message: str, status: int, err_type: str) -> dict:
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": status}
