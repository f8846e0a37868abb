"""--api-workers N (vLLM's --api-server-count): N front-end processes share the server's port
(SO_REUSEPORT: the kernel spreads connections over them), each running the asyncio HTTP
server, parsing, validating, tokenizing and packing requests, and sending their units of work
to the engine processes (runtime.replica_process, one a replica) over ZeroMQ, answers coming
back the same way. This process starts the engine processes, then the front ends; it starts
again a front end that dies (its connections drop, the others serve on) and an engine process
that ends (the front ends, told, fail its requests with 503 and say so on /health until it is
ready); on SIGTERM or SIGINT it stops the front ends, each finishing its requests within the
grace period, then the engines.
"""
import asyncio
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import queue
import signal
import socket
import threading

from absl import logging

from model.loader import load_front
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.replica_process import FrontEnd, ReplicaProcess, start_replica_processes
from server.app import ScoreServer, ServerConfig, serve

START_TIMEOUT_S = 600.0  # a front end reads the tokenizer and imports JAX


@dataclasses.dataclass(frozen=True)
class APIWorkerSpec:
    """What a front end serves, and where."""
    config: ServerConfig
    host: str
    port: int
    grace_s: float


@dataclasses.dataclass(frozen=True)
class _Worker:
    """What a front-end process is started with (pickled to it)."""
    spec: APIWorkerSpec
    index: int
    model_path: str | None
    engine_cfg: EngineConfig
    engines: tuple[str, ...]  # each replica's address


def serve_with_api_workers(model_path: str | None, engine_cfg: EngineConfig, runner_type,
                           spec: APIWorkerSpec, workers: int) -> None:
    """Serves until SIGTERM or SIGINT."""
    cfg, tokenizer, engine_cfg, replicas = start_replica_processes(
        model_path, dataclasses.replace(engine_cfg, replica_processes=True), runner_type)
    engine = Engine(cfg, tokenizer, engine_cfg, replicas)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with _ReservedPort(spec.host, spec.port) as port:
            spec = dataclasses.replace(spec, port=port)
            started = _Worker(spec, 0, model_path, engine.engine_cfg,
                              tuple(r.address for r in engine.schedulers))
            _run_workers(engine, started, workers, stop)
    finally:
        engine.close()


class _ReservedPort:
    """The port bound (not listening: no connection comes to it) with SO_REUSEPORT, so that a
    port of 0 becomes one the front ends can share; held until they are done."""

    def __init__(self, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._socket.bind((host, port))

    def __enter__(self) -> int:
        return self._socket.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self._socket.close()


def _run_workers(engine: Engine, worker: _Worker, n: int, stop: threading.Event) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()  # (a front end's index, its start-up error or "", its address)
    start = lambda k: _start(context, dataclasses.replace(worker, index=k), ready)  # noqa
    front = engine.schedulers[0].front  # watches the engine processes, tells the front ends
    running = {k: start(k) for k in range(n)}
    for _ in range(n):
        index, error, address = ready.get(timeout=START_TIMEOUT_S)
        if error:
            _stop(running.values(), 0)
            raise ValueError(f"front end {index}: {error}")
        front.relay_to(index, address)
    spec = worker.spec
    logging.info("%s", ScoreServer(engine, spec.config).describe_routes())
    logging.info("serving %s: %s, %d front ends (pids %s), on http://%s:%d",
                 spec.config.model_name, engine.describe(), n,
                 " ".join(str(p.pid) for p in running.values()), spec.host, spec.port)
    while not stop.is_set():
        ended = multiprocessing.connection.wait([p.sentinel for p in running.values()],
                                                timeout=0.2)
        for k, process in list(running.items()):
            if process.sentinel in ended and not stop.is_set():
                running[k] = start(k)
                logging.warning("front end %d ended (exit code %s): started again (pid %d)",
                                k, process.exitcode, running[k].pid)
        with contextlib.suppress(queue.Empty):
            while True:  # a front end started again is ready
                index, error, address = ready.get_nowait()
                if not error:
                    front.relay_to(index, address)
    _stop(running.values(), spec.grace_s + 5)


def _start(context, worker: _Worker, ready) -> multiprocessing.Process:
    process = context.Process(target=api_worker_main, args=(worker, ready),
                              name=f"api-worker-{worker.index}", daemon=True)
    process.start()
    return process


def _stop(processes, timeout_s: float) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()  # SIGTERM: the front end finishes what it holds
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()


def api_worker_main(worker: _Worker, ready) -> None:
    """A front end: the model's config and tokenizer, handles on the engine processes, and
    the HTTP server on the shared port until SIGTERM."""
    try:
        cfg, tokenizer = load_front(worker.model_path, worker.engine_cfg.quantization)
        front = FrontEnd()
        replicas = [ReplicaProcess(r, address, front)
                    for r, address in enumerate(worker.engines)]
        front.add(replicas)
        engine = Engine(cfg, tokenizer, worker.engine_cfg, replicas)
    except Exception as e:
        ready.put((worker.index, f"{type(e).__name__}: {e}", ""))
        raise
    spec = worker.spec
    try:
        asyncio.run(serve(engine, spec.config, spec.host, spec.port, spec.grace_s,
                          api_worker=True,
                          listening=lambda: ready.put((worker.index, "", front.address))))
    finally:
        engine.close()
