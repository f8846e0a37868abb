"""Minimal HTTP/1.1 message reading and writing over asyncio streams."""
import asyncio
import dataclasses
import re
import urllib.parse

from runtime.errors import STATUSES, ScoreError
from server.json_codec import to_json


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


class ReadTimeout(HttpError):
    def __init__(self, what: str, seconds: float):
        super().__init__(f"{what} not received within {seconds:g} s", status=408)


class ReadDeadlines:
    """Time limits on reading from connections (the wait for a request's first byte, its
    head, its body), kept by one timer for all of them: setting or clearing a limit is a dict
    write, and a sweep every `period_s` fails each read past its limit with ReadTimeout,
    through its reader (StreamReader.set_exception), at most a period late. asyncio.timeout,
    a timer scheduled and cancelled each wait, cost some 10 µs a wait, three a request."""

    def __init__(self, period_s: float):
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.period_s = period_s
        self._due: dict[asyncio.StreamReader, tuple[float, str, float]] = {}
        self._sweeper: asyncio.Task | None = None

    def set(self, reader: asyncio.StreamReader, seconds: float, what: str) -> None:
        """Reads from `reader` raise ReadTimeout(what, seconds) from `seconds` on, unless
        cleared first."""
        loop = asyncio.get_running_loop()
        self._due[reader] = (loop.time() + seconds, what, seconds)
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())

    def clear(self, reader: asyncio.StreamReader) -> None:
        self._due.pop(reader, None)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._due:
                await asyncio.sleep(self.period_s)
                now = loop.time()
                for reader, (due, what, seconds) in list(self._due.items()):
                    if due <= now:
                        del self._due[reader]
                        reader.set_exception(ReadTimeout(what, seconds))
        finally:
            self._sweeper = None


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one connection may cost the server; a client past a limit is answered and cut off."""
    max_head_bytes: int = 64 << 10   # request line and headers: 431 beyond
    max_body_bytes: int = 8 << 20    # 413 beyond
    idle_timeout_s: float = 75.0     # keep-alive wait for the next request, then close
    header_timeout_s: float = 10.0   # first byte to the end of the head: 408 beyond
    body_timeout_s: float = 30.0     # the whole body: 408 beyond
    send_timeout_s: float = 30.0     # a response the client does not read: abort

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"{field.name} must be positive, got {getattr(self, field.name)}")

    @property
    def sweep_s(self) -> float:
        """How often the read limits are checked (ReadDeadlines): a tenth of the shortest, at
        most a second, so that a limit binds at most 10% late."""
        return min(self.idle_timeout_s, self.header_timeout_s, self.body_timeout_s, 10.0) / 10


TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.6.2
DIGITS = re.compile(r"[0-9]+")  # RFC 9110 8.6: ASCII digits only
# origin-form or absolute-form targets (RFC 9112 3.2)
REQUEST_LINE = re.compile(rf"({TOKEN.pattern}) (/[!-~]*|https?://[!-~]+) (HTTP/\d\.\d)")


def _parse_head(head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    match = REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        raise HttpError(f"malformed request line {lines[0][:80]!r}")
    method, target, version = match.groups()
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(f"unsupported HTTP version {version!r}")
    return Request(method, urllib.parse.urlsplit(target).path or "/", version,
                   _parse_headers(lines[1:]))


def _parse_headers(lines: list[str]) -> dict[str, str]:
    """Lower-cased names; a repeated header's values are joined with commas (RFC 9110 5.3), so
    that two Content-Lengths or Transfer-Encodings are refused rather than one picked."""
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not TOKEN.fullmatch(name):
            raise HttpError(f"malformed header line {line[:80]!r}")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


MAX_TRAILERS = 32
LINGER_S = 2.0  # like nginx's lingering close, shorter: only to let an answer reach the client


def _content_length(req: Request, max_body: int) -> int:
    raw = req.headers.get("content-length", "0")
    if not DIGITS.fullmatch(raw):  # not str.isdigit, which takes "²" that int() refuses
        raise HttpError(f"invalid Content-Length {raw[:40]!r}")
    if int(raw) > max_body:
        raise HttpError(f"body of {raw} bytes exceeds the limit of {max_body}", status=413)
    return int(raw)


def _is_chunked(req: Request) -> bool:
    coding = req.headers.get("transfer-encoding")
    if coding is None:
        return False
    if "content-length" in req.headers:
        raise HttpError("both Transfer-Encoding and Content-Length: send one")
    if not TOKEN.fullmatch(coding):
        raise HttpError(f"malformed Transfer-Encoding {coding[:40]!r}")
    if coding.lower() != "chunked":
        raise HttpError(f"Transfer-Encoding {coding[:40]!r} is not supported; send chunked or "
                        "Content-Length", status=501)
    return True


async def _line(reader: asyncio.StreamReader, what: str) -> bytes:
    try:
        return (await reader.readuntil(b"\r\n"))[:-2]
    except asyncio.LimitOverrunError:
        raise HttpError(f"{what} too long") from None


async def _chunked_body(reader: asyncio.StreamReader, max_body: int) -> bytes:
    """A chunked body (RFC 9112 §7.1); chunk extensions and trailers are read and ignored."""
    body = bytearray()
    while True:
        size_text = (await _line(reader, "chunk size line")).split(b";", 1)[0].strip()
        if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
            raise HttpError(f"invalid chunk size {size_text[:20]!r}")
        size = int(size_text, 16)
        if len(body) + size > max_body:
            raise HttpError(f"body exceeds the limit of {max_body} bytes", status=413)
        if size == 0:
            break
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise HttpError("chunk data not followed by CRLF")
    for _ in range(MAX_TRAILERS + 1):
        if not await _line(reader, "trailer line"):
            return bytes(body)
    raise HttpError(f"more than {MAX_TRAILERS} trailer lines")


async def _continue(req: Request, writer) -> None:
    """Answers `Expect: 100-continue` once the head is accepted, before the body is read."""
    expect = req.headers.get("expect")
    if expect is None:
        return
    if expect.lower() != "100-continue":
        raise HttpError(f"unsupported Expect {expect[:40]!r}", status=417)
    if writer is not None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()


async def _head(reader: asyncio.StreamReader, first: bytes) -> bytes:
    """The request head after its first byte; empty lines before it are skipped (RFC 9112 2.2)."""
    head = first
    while True:
        try:
            head += await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            raise HttpError("connection closed inside the request head") from None
        except asyncio.LimitOverrunError:
            raise HttpError("request head too large", status=431) from None
        if head := head.lstrip(b"\r\n"):
            return head[:-4]


async def _body(reader: asyncio.StreamReader, req: Request, max_body: int, writer) -> bytes:
    if _is_chunked(req):
        await _continue(req, writer)
        return await _chunked_body(reader, max_body)
    length = _content_length(req, max_body)
    await _continue(req, writer)
    return await reader.readexactly(length)


async def read_request(reader: asyncio.StreamReader, limits: Limits, deadlines: ReadDeadlines,
                       writer=None) -> Request | None:
    """The next request on the connection, or None when the client closed it or stayed idle
    past the keep-alive timeout. `writer` answers `Expect: 100-continue`."""
    first = await request_begins(reader, limits, deadlines)
    return (None if first is None else
            await read_request_from(first, reader, limits, deadlines, writer))


async def request_begins(reader: asyncio.StreamReader, limits: Limits,
                         deadlines: ReadDeadlines) -> bytes | None:
    """The next request's first byte, or None when the client closed the connection or stayed
    idle past the keep-alive timeout."""
    deadlines.set(reader, limits.idle_timeout_s, "next request")
    try:
        return await reader.readexactly(1)
    except (asyncio.IncompleteReadError, ReadTimeout):
        return None
    finally:
        deadlines.clear(reader)


async def read_request_from(first: bytes, reader: asyncio.StreamReader, limits: Limits,
                            deadlines: ReadDeadlines, writer=None) -> Request:
    """The request whose first byte was `first` (request_begins)."""
    try:
        deadlines.set(reader, limits.header_timeout_s, "request head")
        req = _parse_head(await _head(reader, first))
        deadlines.set(reader, limits.body_timeout_s, "request body")
        req.body = await _body(reader, req, limits.max_body_bytes, writer)
    except asyncio.IncompleteReadError:
        raise HttpError("connection closed inside the request body") from None
    finally:
        deadlines.clear(reader)
    return req


async def linger(reader: asyncio.StreamReader, writer, seconds: float = LINGER_S) -> None:
    """Half-closes, then discards what the client still sends for up to `seconds`: a client
    still sending (say, a refused body) then reads its answer instead of a connection reset."""
    if reader.at_eof():
        return
    writer.write_eof()
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(1 << 16):
                pass
    except (TimeoutError, ReadTimeout):  # the latter: a read timed out before it
        pass


async def send(writer, data: bytes, timeout_s: float) -> None:
    """Writes `data`; a client that does not read it within `timeout_s` is cut off."""
    writer.write(data)
    if not writer.transport.get_write_buffer_size():  # all of it sent: nothing to time
        return await writer.drain()
    try:
        async with asyncio.timeout(timeout_s):
            await writer.drain()
    except TimeoutError:
        writer.transport.abort()
        raise ConnectionResetError("client did not read its response") from None


def encode_response(status: int, payload, keep_alive: bool, extra_headers=(),
                    content_type: str = "application/json", head_only: bool = False) -> bytes:
    """`payload`: JSON-able, or bytes sent as they are; `head_only` (HEAD) sends no body."""
    body = payload if isinstance(payload, bytes) else to_json(payload)
    head = [f"HTTP/1.1 {status} {STATUSES[status][0]}",
            f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}", *extra_headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else body)


def error_body(message: str, status: int, err_type: str) -> dict:
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": status}
