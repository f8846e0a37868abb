"""Routes of the scoring server, on plain asyncio streams; the model runs in the engine's
scheduler thread, which batches concurrent requests."""
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import os
import signal
import socket
import time
import uuid
from logging import INFO
from typing import Callable, NamedTuple

import jax
from absl import logging

from runtime.engine import Engine
from runtime.errors import STATUSES, ScoreError
from runtime.job import ScoreResult
from runtime.request import RerankRequest, ScoreRequest, parse_rerank_request
from runtime.rerank import RerankResult
from server.access import AccessPolicy
from server.access_log import AccessLog
from server.http import (
    HttpError,
    Limits,
    ReadDeadlines,
    Request,
    encode_response,
    error_body,
    linger,
    read_request_from,
    request_begins,
    send,
)
from server.json_codec import parse_json, parse_score_body
from server.loop_futures import LoopFutures
from server.metrics import ServerMetrics, prometheus_text
from server.profiler import Profiler
from server.text_batches import TextBatches


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str = "default"   # in /v1/models and every response (--served-model-name)
    model_path: str = ""          # what /get_model_info reports
    limits: Limits = Limits()
    max_connections: int = 1024  # open connections; beyond, each request gets a 503
    max_pending: int = 256       # score requests queued or running; beyond, 503
    retry_after_s: int = 1       # the Retry-After of a 503
    gone_poll_s: float = 0.2     # how often a waiting request checks that its client is there
    access_log: bool = True
    trace_dir: str | None = None  # where POST /start_profile writes; None: a new temporary dir
    access: AccessPolicy = AccessPolicy()  # the API key and the admin routes' switch

    def __post_init__(self):
        if self.max_connections < 1 or self.max_pending < 0 or self.retry_after_s < 0:
            raise ValueError(f"max_connections ({self.max_connections}) must be >= 1, "
                             f"max_pending ({self.max_pending}) and retry_after_s "
                             f"({self.retry_after_s}) >= 0")
        if not self.gone_poll_s > 0:
            raise ValueError(f"gone_poll_s must be positive, got {self.gone_poll_s}")


FIRST_REQUEST_WAIT_S = 1.0  # at shutdown, how long a connection with no request yet may take
                            # to send one: its client has just connected to send it
CLIENT_GONE = 499  # nginx's status for a client that closed before its answer
RERANK_ROUTES = ("/v1/rerank", "/v2/rerank", "/rerank")  # vLLM's, Cohere's v2, Jina's


class Answer(NamedTuple):
    status: int
    payload: dict | str | None
    headers: list[str]
    items: int = 0  # items or documents scored, for the metrics and the access log


class ScoreServer:
    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()):
        self.engine, self.config = engine, config
        self.metrics = ServerMetrics()
        self.profiler = Profiler(config.trace_dir)
        self._pending = 0       # score requests submitted and not answered
        self._busy = 0          # requests being read or answered, of any route
        self._closing = False
        self._connections: set[asyncio.Task] = set()
        self._unopened: set[asyncio.Task] = set()  # connections no request has come on yet
        self._waiting: dict[asyncio.Future, Callable[[], bool]] = {}  # results, client gone?
        self._clients_gone: set[asyncio.Future] = set()
        self._watch: asyncio.Task | None = None  # looks for them every gone_poll_s
        self._deadlines = ReadDeadlines(config.limits.sweep_s)
        self._results: LoopFutures | None = None  # the engine's futures, on the loop
        self._access_log = AccessLog()
        self._text_batches = TextBatches(engine.submit_all)
        self._routes = {"/v1/score": ("POST", self._score),
                        **{path: ("POST", self._rerank) for path in RERANK_ROUTES},
                        "/health": ("GET", self._health),
                        "/v1/models": ("GET", self._models),
                        "/get_model_info": ("GET", self._model_info),
                        "/metrics": ("GET", self._metrics),
                        "/flush_cache": ("POST", self._flush_cache),
                        "/start_profile": ("POST", self._start_profile),
                        "/stop_profile": ("POST", self._stop_profile)}

    async def start(self, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
        """`reuse_port`: the port shared with other processes' servers (SO_REUSEPORT)."""
        return await asyncio.get_running_loop().create_server(
            self._protocol, host, port, reuse_port=reuse_port or None)

    def _protocol(self) -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(
            asyncio.StreamReader(limit=self.config.limits.max_head_bytes),
            self.handle_connection)

    async def shutdown(self, listener: asyncio.Server, grace_s: float) -> None:
        """Stops listening, lets requests in flight finish (up to `grace_s`), then closes
        every connection. In flight: each request whose first byte has come, and, for
        FIRST_REQUEST_WAIT_S after the last of those, the first request of a connection."""
        self._closing = True
        await self._stop_listening(listener)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        idle_since = loop.time()
        while loop.time() < deadline:
            if self._busy:
                idle_since = loop.time()
            elif not self._unopened or loop.time() - idle_since > FIRST_REQUEST_WAIT_S:
                break
            await asyncio.sleep(0.02)
        if self._watch is not None:
            self._watch.cancel()
        self._deadlines.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self._access_log.flush()

    async def _stop_listening(self, listener: asyncio.Server) -> None:
        """Closes the listener, first taking the connections the kernel has queued on it:
        closing would reset them (with SO_REUSEPORT, each process's queue is its own)."""
        loop = asyncio.get_running_loop()
        queued = []
        for listening in listener.sockets:
            loop.remove_reader(listening.fileno())
            with socket.socket(fileno=os.dup(listening.fileno())) as sock:
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    while True:
                        queued.append(sock.accept()[0])
        listener.close()
        for conn in queued:
            conn.setblocking(False)
            await loop.connect_accepted_socket(self._protocol, conn)

    async def handle_connection(self, reader, writer) -> None:
        task = asyncio.current_task()
        over_limit = len(self._connections) >= self.config.max_connections
        self._connections.add(task)
        self._unopened.add(task)
        try:
            while await self._serve_one(reader, writer, over_limit):
                pass
            await linger(reader, writer)
        except ConnectionError:
            pass
        finally:
            self._connections.discard(task)
            self._unopened.discard(task)
            writer.close()

    async def _serve_one(self, reader, writer, over_limit: bool) -> bool:
        """Reads and answers one request; False when the connection is to be closed."""
        first = await request_begins(reader, self.config.limits, self._deadlines)
        self._unopened.discard(asyncio.current_task())
        if first is None:
            return False
        self._busy += 1
        try:
            try:
                req = await read_request_from(first, reader, self.config.limits,
                                              self._deadlines, writer)
            except HttpError as e:
                await self._respond(writer, None, time.perf_counter(), self._error(e), False)
                return False
            start = time.perf_counter()
            if over_limit:
                answer = self._error(ScoreError("too many open connections, retry later", 503))
            else:
                with jax.profiler.TraceAnnotation("http_request"):
                    answer = await self._dispatch(
                        req, lambda: reader.at_eof() or writer.is_closing())
            if answer.status == CLIENT_GONE:
                self._record(writer, req, start, CLIENT_GONE, 0)
                return False
            keep_alive = req.keep_alive and not self._closing and not over_limit
            await self._respond(writer, req, start, answer, keep_alive)
        finally:
            self._busy -= 1
        return keep_alive

    async def _respond(self, writer, req: Request | None, start: float, answer,
                       keep_alive: bool) -> None:
        status, payload, headers, items = answer
        text = isinstance(payload, str)  # /metrics
        data = encode_response(status, payload.encode() if text else payload, keep_alive,
                               headers, "text/plain; version=0.0.4" if text else
                               "application/json", head_only=req is not None and
                               req.method == "HEAD")
        self._record(writer, req, start, status, items)
        await send(writer, data, self.config.limits.send_timeout_s)

    def _record(self, writer, req: Request | None, start: float, status: int,
                items: int) -> None:
        """The request's metrics and access log line."""
        seconds = time.perf_counter() - start
        route = req.path if req is not None and req.path in self._routes else "other"
        self.metrics.observe(route, status, seconds, items)
        if self.config.access_log and logging.get_absl_logger().isEnabledFor(INFO):
            method, path = (req.method, req.path) if req is not None else ("-", "-")
            peer = writer.get_extra_info("peername")
            self._access_log.line("%s %s %s %d items=%d %.1fms" % (
                "%s:%s" % peer[:2] if peer else "-", method,
                path if path.isprintable() else ascii(path), status, items, seconds * 1e3))

    def _error(self, e: ScoreError) -> Answer:
        headers = {503: [f"Retry-After: {self.config.retry_after_s}"],
                   401: ["WWW-Authenticate: Bearer"]}.get(e.status, [])
        return Answer(e.status, error_body(e.message, e.status, e.type), headers)

    def describe_routes(self) -> str:
        return self.config.access.describe(self._routes)

    async def _dispatch(self, req: Request, gone: Callable[[], bool]) -> Answer:
        route = self._routes.get(req.path)
        try:
            self.config.access.check(req.path, req.headers.get("authorization"))
            if route is None:
                raise ScoreError(f"no route {req.path}", status=404)
            allowed = ("GET", "HEAD") if route[0] == "GET" else (route[0],)
            if req.method not in allowed:
                return Answer(405, error_body(f"{req.path} allows only {' and '.join(allowed)}",
                                              405, STATUSES[405][1]),
                              [f"Allow: {', '.join(allowed)}"])
            answer = await route[1](req, gone)
            return answer if isinstance(answer, Answer) else Answer(200, answer, [])
        except ScoreError as e:
            return self._error(e)
        except ConnectionError:
            return Answer(CLIENT_GONE, None, [])
        except Exception as e:  # a bug: report it, keep serving
            logging.exception("error serving %s %s", req.method, req.path)
            return self._error(ScoreError(f"internal error: {e}", 500))

    async def _score(self, req: Request, gone) -> Answer:
        with jax.profiler.TraceAnnotation("parse_request"):
            score_req = parse_score_body(req.body, not self.engine.cfg.is_classifier)
        submit = (functools.partial(self._text_batches.submit, score_req) if score_req.is_text
                  else functools.partial(self.engine.submit, score_req))
        result = await self._queued(submit, gone)
        return Answer(200, score_response(score_req, result, self.config.model_name), [],
                      len(result.scores))

    async def _rerank(self, req: Request, gone) -> Answer:
        with jax.profiler.TraceAnnotation("parse_request"):
            rerank_req = parse_rerank_request(parse_json(req.body))
        result = await self._queued(functools.partial(
            asyncio.get_running_loop().run_in_executor, None, self.engine.submit_rerank,
            rerank_req), gone)
        return Answer(200, rerank_response(rerank_req, result, self.config.model_name), [],
                      len(rerank_req.documents))

    async def _queued(self, submit, gone):
        """The result of the engine's future that `submit()` gives (or an awaitable of it),
        unless the server is saturated (503) or the client goes away first (its work is
        dropped). Text is tokenized off the event loop (the tokenizer releases the
        interpreter lock); token ids are checked and packed on it, cheaper than a thread's
        hop and back."""
        if self._pending >= self.config.max_pending:
            raise ScoreError("server is saturated, retry later", status=503)
        self._pending += 1
        try:
            future = submit()
            if not isinstance(future, concurrent.futures.Future):
                future = await future
            return await self._result_unless_gone(future, gone)
        finally:
            self._pending -= 1

    async def _result_unless_gone(self, future, gone):
        """The request's result; if its client disconnects first, its work is dropped."""
        if self._results is None:
            self._results = LoopFutures(asyncio.get_running_loop())
        waiting = self._results.wrap(future)
        self._waiting[waiting] = gone
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_clients())
        try:
            return await waiting
        except asyncio.CancelledError:
            if waiting in self._clients_gone:
                raise ConnectionResetError("client went away") from None
            raise
        finally:
            del self._waiting[waiting]
            self._clients_gone.discard(waiting)
            future.cancel()  # no-op once answered

    async def _watch_clients(self) -> None:
        """One timer for every waiting request, not one each."""
        while True:
            await asyncio.sleep(self.config.gone_poll_s)
            for waiting, gone in list(self._waiting.items()):
                if gone():
                    self._clients_gone.add(waiting)
                    waiting.cancel()

    async def _health(self, req: Request, gone) -> dict:
        down = [f"replica {k}: {replica.down}" for k, replica in
                enumerate(self.engine.schedulers) if replica.down]
        if down:
            raise ScoreError("; ".join(down), status=503)
        return {"status": "ok"}

    async def _flush_cache(self, req: Request, gone) -> dict:
        return {"flushed_pages": self.engine.flush_prefix_cache()}

    async def _start_profile(self, req: Request, gone) -> dict:
        loop = asyncio.get_running_loop()
        return {"trace_dir": await loop.run_in_executor(None, self.profiler.start)}

    async def _stop_profile(self, req: Request, gone) -> dict:
        loop = asyncio.get_running_loop()
        return {"trace_dir": await loop.run_in_executor(None, self.profiler.stop)}

    async def _statuses(self) -> list:
        """The replicas' ReplicaStatus, off the event loop: engine processes are asked."""
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.statuses)

    async def _metrics(self, req: Request, gone) -> str:
        return prometheus_text(self.engine, await self._statuses(), self.metrics, {
            "jax_score_open_connections": len(self._connections),
            "jax_score_pending_requests": self._pending})

    async def _models(self, req: Request, gone) -> dict:
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "owned_by": "jax-score",
            "max_model_len": self.engine.max_prompt_tokens}]}

    async def _model_info(self, req: Request, gone) -> dict:
        cfg, statuses = self.engine.cfg, await self._statuses()
        return {"model_path": self.config.model_path, "is_generation": not cfg.is_classifier,
                "architecture": cfg.family, "vocab_size": cfg.vocab_size,
                "num_labels": cfg.num_labels, "max_context": cfg.max_context,
                "dtype": self.engine.engine_cfg.dtype,
                "quantization": cfg.quantization or "none",
                "kernel_backend": statuses[0].backend,
                "tp_size": self.engine.engine_cfg.tp_size,
                "dp_size": self.engine.engine_cfg.dp_size,
                "compilations": sum(s.compilations for s in statuses)}


async def serve(engine: Engine, config: ServerConfig, host: str, port: int, grace_s: float,
                api_worker: bool = False, listening=lambda: None) -> None:
    """Serves until SIGTERM or SIGINT, then lets requests in flight finish within `grace_s`.
    `api_worker`: one of --api-workers front ends sharing the port (server.api_workers),
    which announces nothing: the process that started it does, once each has called
    `listening`."""
    server = ScoreServer(engine, config)
    listener = await server.start(host, port, reuse_port=api_worker)
    gc.freeze()  # what start-up made (JAX's, the model's objects) is never scanned again
    listening()
    if not api_worker:
        port = listener.sockets[0].getsockname()[1]
        logging.info("%s", server.describe_routes())
        logging.info("serving %s: %s, on http://%s:%d", config.model_name, engine.describe(),
                     host, port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.info("stopping: finishing requests in flight (up to %.0f s)", grace_s)
    await server.shutdown(listener, grace_s)


def score_response(req: ScoreRequest, result: ScoreResult, model: str) -> dict:
    """SGLang's /v1/score response body; `model`: the served model's name."""
    n = result.prompt_tokens
    return {"scores": result.scores, "model": model, "object": "scoring",
            "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


def rerank_response(req: RerankRequest, result: RerankResult, model: str) -> dict:
    """Cohere's and Jina's response body: the results most relevant first; `model`: the
    served model's name."""
    results = [{"index": k, "relevance_score": score,
                **({"document": {"text": req.documents[k]}} if req.return_documents else {})}
               for k, score in result.ranking]
    n = result.prompt_tokens
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
