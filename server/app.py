"""Routes of the scoring server, on plain asyncio streams; the model runs in the engine's
scheduler thread, which batches concurrent requests."""
import asyncio
import dataclasses
import json
from typing import Callable

from absl import logging

from runtime.engine import Engine
from runtime.errors import ScoreError
from runtime.request import parse_score_request
from server.http import HttpError, Request, encode_response, error_body, read_request
from server.metrics import prometheus_text


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str = "default"
    max_body_bytes: int = 8 << 20
    max_pending: int = 256    # requests queued or running before 503
    head_limit: int = 64 << 10
    gone_poll_s: float = 0.2  # how often a waiting request checks that its client is still there


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes):
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ScoreError("request body is not valid UTF-8") from None
    except RecursionError:
        raise ScoreError("request body is nested too deeply") from None
    except ValueError as e:
        raise ScoreError(f"invalid JSON body: {e}") from None


class ScoreServer:
    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()):
        self.engine, self.config = engine, config
        self._pending = 0       # score requests submitted and not answered
        self._busy = 0          # requests being answered, of any route
        self._closing = False
        self._connections: set[asyncio.Task] = set()
        self._routes = {"/v1/score": ("POST", self._score), "/health": ("GET", self._health),
                        "/v1/models": ("GET", self._models),
                        "/get_model_info": ("GET", self._model_info),
                        "/metrics": ("GET", self._metrics),
                        "/flush_cache": ("POST", self._flush_cache)}

    async def start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self.handle_connection, host, port,
                                          limit=self.config.head_limit)

    async def shutdown(self, grace_s: float) -> None:
        """After the listener is closed: lets requests in flight finish (up to `grace_s`),
        then closes every connection."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._busy and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def handle_connection(self, reader, writer) -> None:
        self._connections.add(asyncio.current_task())
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(asyncio.current_task())
            writer.close()

    async def _serve_one(self, reader, writer) -> bool:
        try:
            req = await read_request(reader, self.config.max_body_bytes, writer)
        except HttpError as e:
            writer.write(encode_response(e.status, error_body(e.message, e.status, e.type), False))
            await writer.drain()
            return False
        if req is None:
            return False
        self._busy += 1
        try:
            gone = lambda: reader.at_eof() or writer.is_closing()  # noqa: E731
            status, payload, headers = await self._dispatch(req, gone)
            keep_alive = req.keep_alive and not self._closing
            text = isinstance(payload, str)  # /metrics
            writer.write(encode_response(
                status, payload.encode() if text else payload, keep_alive, headers,
                "text/plain; version=0.0.4" if text else "application/json",
                head_only=req.method == "HEAD"))
            await writer.drain()
        finally:
            self._busy -= 1
        return keep_alive

    async def _dispatch(self, req: Request, gone: Callable[[], bool]):
        route = self._routes.get(req.path)
        try:
            if route is None:
                raise ScoreError(f"no route {req.path}", status=404)
            allowed = ("GET", "HEAD") if route[0] == "GET" else (route[0],)
            if req.method not in allowed:
                return 405, error_body(f"{req.path} allows only {' and '.join(allowed)}", 405,
                                       ScoreError.TYPES[405]), [f"Allow: {', '.join(allowed)}"]
            return 200, await route[1](req, gone), []
        except ScoreError as e:
            return e.status, error_body(e.message, e.status, e.type), []
        except ConnectionError:
            raise
        except Exception as e:  # a bug: report it, keep serving
            logging.exception("error serving %s %s", req.method, req.path)
            return 500, error_body(f"internal error: {e}", 500, ScoreError.TYPES[500]), []

    async def _score(self, req: Request, gone) -> dict:
        score_req = parse_score_request(parse_json(req.body), not self.engine.cfg.is_classifier)
        if self._pending >= self.config.max_pending:
            raise ScoreError("server is saturated, retry later", status=503)
        self._pending += 1
        try:  # tokenizing runs off the event loop
            future = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.submit, score_req)
            result = await self._result_unless_gone(future, gone)
        finally:
            self._pending -= 1
        n = result.prompt_tokens
        return {"scores": result.scores, "model": score_req.model, "object": "scoring",
                "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}

    async def _result_unless_gone(self, future, gone):
        """The request's result; if its client disconnects first, its work is dropped."""
        waiting = asyncio.wrap_future(future)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self.config.gone_poll_s)
                if done:
                    return waiting.result()
                if gone():
                    raise ConnectionResetError("client went away")
        finally:
            future.cancel()  # no-op once answered

    async def _health(self, req: Request, gone) -> dict:
        return {"status": "ok"}

    async def _flush_cache(self, req: Request, gone) -> dict:
        return {"flushed_pages": self.engine.scheduler.flush_prefix_cache()}

    async def _metrics(self, req: Request, gone) -> str:
        return prometheus_text(self.engine)

    async def _models(self, req: Request, gone) -> dict:
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "owned_by": "jax-score",
            "max_model_len": self.engine.max_prompt_tokens}]}

    async def _model_info(self, req: Request, gone) -> dict:
        cfg = self.engine.cfg
        return {"model_path": self.config.model_name, "is_generation": not cfg.is_classifier,
                "architecture": cfg.family, "vocab_size": cfg.vocab_size,
                "num_labels": cfg.num_labels, "max_context": cfg.max_context,
                "dtype": self.engine.engine_cfg.dtype,
                "attention_backend": self.engine.runner.backend,
                "compilations": self.engine.runner.compile_count}
