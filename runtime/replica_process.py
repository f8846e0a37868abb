"""Data parallel replicas in engine processes of their own (the server's --dp-size > 1).

Each engine process runs one replica's runner and scheduler on the devices it alone sees (TPU
chips by the TPU runtime's visibility variables, GPUs by CUDA_VISIBLE_DEVICES, on CPU its
group of CPU devices). The front end (HTTP, parsing, tokenizing, packing, routing) sends it a
request's units of work over ZeroMQ and keeps the request's Job, answered as its units'
scores come back; so no replica waits on the front end's interpreter lock or on another's.

An engine process pulls work at its own address, and sends each job's results to the address
its front end named; messages are msgspec structs in MessagePack, arrays as raw bytes. An
engine process exits when the process that started it is gone.
"""
import concurrent.futures
import dataclasses
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading

import jax
import msgspec
import numpy as np
import zmq
from absl import logging

from model.loader import load_front, load_model
from runtime.engine_config import EngineConfig
from runtime.errors import ScoreError
from runtime.job import Job, Unit
from runtime.packing import Sequence
from runtime.replicas import local_replicas
from runtime.scheduler import ReplicaStatus, Scheduler

START_TIMEOUT_S = 3600.0  # loading, quantizing and compiling a large model
ASK_TIMEOUT_S = 30.0
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}  # chips a process
TPU_FIRST_PORT = 8476
OUTBOX_MESSAGES = 100_000  # queued for a front end that is gone, beyond which they drop


class WireUnit(msgspec.Struct, array_like=True):
    tokens: bytes  # int32 arrays, as packing.Sequence holds them
    bounds: bytes
    score_rows: bytes
    shared_len: int
    cacheable: int
    first_row: int
    start: int  # the job's items it scores: [start, stop)
    stop: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    front: str  # where the results go
    job: int
    labels: list[int]
    kind: str
    units: list[WireUnit]


class Cancel(msgspec.Struct, tag=True, array_like=True):
    front: str
    job: int


class Ask(msgspec.Struct, tag=True, array_like=True):
    front: str
    ask: int
    op: str  # status, flush, check_pages or close


class Done(msgspec.Struct, array_like=True):
    job: int
    start: int
    stop: int
    scores: bytes  # float64 [stop - start, labels]
    prompt_tokens: int


class Dones(msgspec.Struct, tag=True, array_like=True):
    """A forward's results for one front end."""
    done: list[Done]


class Failed(msgspec.Struct, tag=True, array_like=True):
    job: int
    message: str
    status: int


class Reply(msgspec.Struct, tag=True, array_like=True):
    ask: int
    status: ReplicaStatus | None = None
    pages: int = 0
    error: str = ""


class Ready(msgspec.Struct, tag=True, array_like=True):
    replica: int
    dtype: str = ""
    status: ReplicaStatus | None = None
    error: str = ""


class Lost(msgspec.Struct, tag=True, array_like=True):
    """From the front end that watches the engine processes to the others (server.api_workers):
    a replica's process ended; it is `restarting`, or `lost` says why it stays down; `status`:
    the last it gave."""
    replica: int
    message: str
    restarting: bool
    lost: str = ""
    status: ReplicaStatus | None = None


_TO_ENGINE = msgspec.msgpack.Decoder(Submit | Cancel | Ask)
_TO_FRONT = msgspec.msgpack.Decoder(Dones | Failed | Reply | Ready | Lost)
_ENCODE = msgspec.msgpack.Encoder()


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What an engine process needs to make its replica (it is pickled to start it)."""
    model_path: str | None
    engine_cfg: EngineConfig
    replica: int
    runner_type: object  # as runtime.replicas.local_replicas takes it
    address: str         # where it pulls work
    front: str           # where it says it is ready
    jax_settings: tuple[tuple[str, object], ...]  # jax.config values to start with


def start_replica_processes(model_path: str | None, engine_cfg: EngineConfig, runner_type,
                            restart: bool = True):
    """One engine process a replica, each ready (its programs compiled): (the model's config,
    its tokenizer, engine_cfg with its dtype resolved, a ReplicaProcess a replica). A replica
    that cannot start stops the others and raises its error as a ValueError. `restart`: an
    engine process that ends after it was ready is started again (its programs from the
    compile cache), and its replica takes work once that one is ready."""
    cfg, tokenizer = load_front(model_path, engine_cfg.quantization)
    settings = tuple((name, getattr(jax.config, name)) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_platforms"))
    front = FrontEnd()
    context = multiprocessing.get_context("spawn")
    address = lambda r: f"ipc://{front.directory}/engine-{r}"  # noqa: E731

    def start(r: int) -> multiprocessing.Process:
        spec = ReplicaSpec(model_path, engine_cfg, r, runner_type, address(r), front.address,
                           settings)
        process = context.Process(target=engine_process_main, args=(spec,),
                                  name=f"engine-{r}", daemon=True)
        process.start()
        logging.info("replica %d: engine process %d", r, process.pid)
        return process

    replicas = [ReplicaProcess(r, address(r), front, start(r))
                for r in range(engine_cfg.dp_size)]
    front.watch(replicas, start if restart else None)
    try:
        dtypes = front.wait_ready(replicas, START_TIMEOUT_S)
    except BaseException:
        for replica in replicas:
            replica.close(timeout_s=0)
        raise
    return cfg, tokenizer, dataclasses.replace(engine_cfg, dtype=dtypes[0]), replicas


class ReplicaProcess:
    """A front end's handle on a replica in an engine process at `address`: the part of
    Scheduler's interface the engine and its router use. The front end that started the
    process holds it (`process`), and closing this handle closes it; other front ends
    (server.api_workers) only send it work."""

    def __init__(self, replica: int, address: str, front: "FrontEnd", process=None):
        self.replica, self.address, self.process, self.front = replica, address, process, front
        self.alive, self.closing = True, False
        self.restarting, self.lost = False, ""  # lost: why it stays down
        self.last_status: ReplicaStatus | None = None  # from Ready on; a dead one's last
        self.load_tokens = 0  # of units sent and not yet answered; under front's lock
        self._sockets = threading.local()  # a PUSH socket a sending thread: no lock to wait on
        self._all_sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()

    @property
    def load(self) -> int:
        return self.load_tokens if self.alive else sys.maxsize

    @property
    def down(self) -> str:
        """Why it takes no work; "" while it does."""
        if self.alive:
            return ""
        return "its engine process is starting again" if self.restarting else (
            self.lost or "its engine process ended")

    def submit(self, job: Job, units: list[Unit]) -> None:
        job_id = self.front.track(job, units, self)
        wire = [WireUnit(u.seq.tokens.tobytes(), u.seq.bounds.tobytes(),
                         u.seq.score_rows.tobytes(), u.seq.shared_len, u.seq.cacheable,
                         u.seq.first_row, u.items.start, u.items.stop) for u in units]
        try:
            self.send(Submit(self.front.address, job_id, job.labels, job.kind, wire))
        except ScoreError as e:
            job.fail(e)  # forgotten as it settles
            raise

    def send(self, message) -> None:
        if not self.alive:
            raise ScoreError(f"replica {self.replica} is down", status=503)
        socket = getattr(self._sockets, "push", None)
        if socket is None:
            with self._sockets_lock:
                socket = self._sockets.push = self.front.context.socket(zmq.PUSH)
                socket.connect(self.address)
                self._all_sockets.append(socket)
        try:
            socket.send(_ENCODE.encode(message))
        except zmq.ZMQError as e:  # closed meanwhile
            raise ScoreError(f"replica {self.replica} is down ({e})", status=503) from None

    def status(self) -> ReplicaStatus:
        """Its own, or once its process has ended, the last it gave."""
        try:
            self.last_status = self.front.ask(self, "status").status
        except ScoreError:
            pass
        return self.last_status

    def flush_prefix_cache(self) -> int:
        return self.front.ask(self, "flush").pages

    def check_pages(self) -> None:
        error = self.front.ask(self, "check_pages").error
        if error:
            raise AssertionError(f"replica {self.replica}: {error}")

    def close(self, timeout_s: float = 60.0) -> None:
        """Forwards in flight answered, waiting units failed (503), then the process ends;
        killed if that takes over `timeout_s`."""
        self.closing = True
        if self.process is not None:
            if timeout_s and self.alive and self.process.is_alive():
                try:
                    self.front.ask(self, "close", timeout_s)
                except (ScoreError, TimeoutError):
                    pass
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.alive = False
        with self._sockets_lock:
            for socket in self._all_sockets:
                socket.close(linger=0)
        self.front.closed(self)


@dataclasses.dataclass(eq=False)
class _Tracked:
    job: Job
    replica: ReplicaProcess
    tokens: dict[int, int]  # a unit's first item -> its tokens, until it is answered


class FrontEnd:
    """A front end's end of the wire: where its results arrive (a thread reads them), the
    jobs it has sent and the questions it has asked, by their ids."""

    def __init__(self):
        self.context = zmq.Context()
        self.directory = tempfile.mkdtemp(prefix="jax-score-")
        self.address = f"ipc://{self.directory}/front-{os.getpid()}"
        self._inbox = self.context.socket(zmq.PULL)
        self._inbox.bind(self.address)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._jobs: dict[int, _Tracked] = {}
        self._asks: dict[int, tuple[ReplicaProcess, concurrent.futures.Future]] = {}
        self._open: set[ReplicaProcess] = set()
        self._by_index: dict[int, ReplicaProcess] = {}
        self._ready: dict[int, Ready] = {}
        self._ready_changed = threading.Condition(self._lock)
        self._followers: dict[int, str] = {}  # the other front ends' addresses, by key
        self._relay = _Outbox(self.context)
        self._reader = threading.Thread(target=self._read, name="front-end results",
                                        daemon=True)
        self._reader.start()

    def track(self, job: Job, units: list[Unit], replica: ReplicaProcess) -> int:
        """The job's id on the wire; its units' tokens count in the replica's load until
        answered, and the job is forgotten once settled (cancelled: the replica is told)."""
        job_id = next(self._ids)
        tokens = {u.items.start: len(u.seq.tokens) for u in units}
        with self._lock:
            self._jobs[job_id] = _Tracked(job, replica, tokens)
            replica.load_tokens += sum(tokens.values())
        job.future.add_done_callback(lambda f: self._settled(job_id, f.cancelled()))
        return job_id

    def _settled(self, job_id: int, cancelled: bool) -> None:
        with self._lock:
            tracked = self._jobs.pop(job_id, None)
            if tracked is not None:
                tracked.replica.load_tokens -= sum(tracked.tokens.values())
        if tracked is not None and cancelled:
            try:
                tracked.replica.send(Cancel(self.address, job_id))
            except ScoreError:
                pass  # its replica is gone, and its work with it

    def ask(self, replica: ReplicaProcess, op: str,
            timeout_s: float = ASK_TIMEOUT_S) -> Reply:
        ask_id, answer = next(self._ids), concurrent.futures.Future()
        with self._lock:
            self._asks[ask_id] = (replica, answer)
        replica.send(Ask(self.address, ask_id, op))
        try:
            return answer.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"replica {replica.replica} did not answer {op!r} in "
                               f"{timeout_s:.0f} s") from None
        finally:
            with self._lock:
                self._asks.pop(ask_id, None)

    def wait_ready(self, replicas: list[ReplicaProcess], timeout_s: float) -> list[str]:
        """Each replica's dtype once all are ready; a replica's start-up error as ValueError."""
        with self._ready_changed:
            ok = self._ready_changed.wait_for(
                lambda: len(self._ready) == len(replicas)
                or any(r.error for r in self._ready.values()), timeout_s)
            ready = dict(self._ready)
        failed = [r for r in ready.values() if r.error]
        if failed:
            raise ValueError(failed[0].error)
        if not ok:
            raise TimeoutError(f"{len(replicas) - len(ready)} replica(s) not ready in "
                               f"{timeout_s:.0f} s")
        kinds = {f"{r.status.platform} ({r.status.device_kind})" for r in ready.values()}
        if len(kinds) > 1:  # a replica left without devices of its own fell back to the CPU
            raise ValueError(f"the replicas run on {' and '.join(sorted(kinds))}: --dp-size x "
                             "--tp-size needs that many devices of one kind")
        for replica in replicas:
            replica.last_status = ready[replica.replica].status
        return [ready[r.replica].dtype for r in replicas]

    def add(self, replicas: list[ReplicaProcess]) -> None:
        """Handles this end serves; once all are closed, it closes."""
        self._open.update(replicas)
        self._by_index.update((r.replica, r) for r in replicas)

    def relay_to(self, key: int, address: str) -> None:
        """The front end at `address` (replacing the one under `key`) hears of each engine
        process lost and back, and now of those down."""
        with self._lock:
            replaced = self._followers.get(key)
            self._followers[key] = address
            down = [r for r in self._by_index.values() if not r.alive]
        if replaced is not None:
            self._relay.forget(replaced)
        for replica in down:
            self._relay.send(address, _lost(replica, f"replica {replica.replica} is down"))

    def _relay_all(self, message) -> None:
        with self._lock:
            followers = list(self._followers.values())
        for address in followers:
            self._relay.send(address, message)

    def watch(self, replicas: list[ReplicaProcess], restart=None) -> None:
        """`add`, and a thread that fails an engine process's jobs and questions when it
        ends, and starts it again by `restart(replica)` if given (once it had been ready)."""
        self.add(replicas)
        threading.Thread(target=self._watch, args=(replicas, restart), name="engine watch",
                         daemon=True).start()

    def _watch(self, replicas: list[ReplicaProcess], restart) -> None:
        running = {r.process.sentinel: r for r in replicas}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                replica = running.pop(sentinel)
                error = self._lost(replica)
                with self._lock:
                    was_ready = self._ready.get(replica.replica)
                    again = (restart is not None and not replica.closing and not replica.lost
                             and was_ready is not None and not was_ready.error)
                    if again:
                        del self._ready[replica.replica]
                        replica.restarting = True
                if not replica.closing:
                    self._relay_all(_lost(replica, error.message))
                if again:
                    replica.process = restart(replica.replica)
                    running[replica.process.sentinel] = replica

    def _lost(self, replica: ReplicaProcess) -> ScoreError:
        """Its jobs and questions failed with the error returned."""
        replica.alive = False
        replica.process.join(5)  # its sentinel may be ready just before it exits
        code = replica.process.exitcode
        error = ScoreError(f"replica {replica.replica}'s engine process ended (exit code "
                           f"{code})", status=503)
        with self._ready_changed:
            if replica.restarting:  # it ended again before it was ready: it stays down
                replica.restarting = False
                replica.lost = f"its engine process could not start again (exit code {code})"
            self._ready.setdefault(replica.replica, Ready(
                replica.replica, error=f"replica {replica.replica}'s engine process ended "
                f"(exit code {code}) before it was ready"))
            self._ready_changed.notify_all()
        if code and not replica.closing:
            logging.error("replica %d's engine process ended with exit code %s",
                          replica.replica, code)
        self._fail(replica, error)
        return error

    def _told_lost(self, message: Lost) -> None:
        """Another front end watches the engine processes (server.api_workers)."""
        replica = self._by_index[message.replica]
        replica.alive, replica.restarting, replica.lost = False, message.restarting, message.lost
        replica.last_status = replica.last_status or message.status
        self._fail(replica, ScoreError(message.message, status=503))

    def _fail(self, replica: ReplicaProcess, error: ScoreError) -> None:
        with self._lock:
            jobs = [t.job for t in self._jobs.values() if t.replica is replica]
            asks = [a for r, a in self._asks.values() if r is replica]
        for job in jobs:
            job.fail(error)
        for answer in asks:
            _settle(answer, lambda f: f.set_exception(error))

    def _back(self, ready: Ready) -> None:
        """A restarted engine process is ready (or says why it cannot be)."""
        self._relay_all(ready)
        replica = self._by_index[ready.replica]
        replica.restarting = False
        if ready.error:
            replica.lost = ready.error
            logging.error("replica %d stays down: %s", ready.replica, ready.error)
            return
        replica.last_status, replica.alive = ready.status, True
        logging.info("replica %d serves again", ready.replica)

    def _read(self) -> None:
        while True:
            try:
                message = _TO_FRONT.decode(self._inbox.recv())
            except zmq.ContextTerminated:
                self._inbox.close(linger=0)
                return
            if isinstance(message, Dones):
                for done in message.done:
                    self._done(done)
            elif isinstance(message, Failed):
                tracked = self._jobs.get(message.job)
                if tracked is not None:
                    tracked.job.fail(ScoreError(message.message, message.status))
            elif isinstance(message, Lost):
                self._told_lost(message)
            elif isinstance(message, Reply):
                with self._lock:
                    replica, answer = self._asks.get(message.ask, (None, None))
                if answer is not None:
                    _settle(answer, lambda f: f.set_result(message))
            else:
                with self._ready_changed:
                    self._ready[message.replica] = message
                    self._ready_changed.notify_all()
                    back = self._by_index[message.replica].restarting
                if back:
                    self._back(message)

    def _done(self, message: Done) -> None:
        with self._lock:
            tracked = self._jobs.get(message.job)
            if tracked is None:
                return  # settled already (cancelled or failed)
            tracked.replica.load_tokens -= tracked.tokens.pop(message.start)
        scores = np.frombuffer(message.scores, np.float64)
        tracked.job.unit_done(range(message.start, message.stop),
                              scores.reshape(message.stop - message.start, -1),
                              message.prompt_tokens)

    def closed(self, replica: ReplicaProcess) -> None:
        """`replica` is closed; once all are, so is this end (its reader stops)."""
        with self._lock:
            self._open.discard(replica)
            last = not self._open
        if last:
            self.close()

    def close(self) -> None:
        self._relay.close()
        self.context.term()  # the reader's recv raises ContextTerminated and closes the inbox
        self._reader.join()
        shutil.rmtree(self.directory, ignore_errors=True)


def _lost(replica: ReplicaProcess, message: str) -> Lost:
    return Lost(replica.replica, message, replica.restarting, replica.lost, replica.last_status)


def _settle(answer: concurrent.futures.Future, how) -> None:
    try:
        how(answer)
    except concurrent.futures.InvalidStateError:
        pass  # its replica was lost as it answered


# The engine process's side.

class _Outbox:
    """Messages to front ends (an engine's results, the watching front end's news of the
    engines), a PUSH socket each, from any thread."""

    def __init__(self, context: zmq.Context):
        self.context, self._sockets, self._lock = context, {}, threading.Lock()

    def send(self, front: str, message) -> None:
        data = _ENCODE.encode(message)
        with self._lock:
            socket = self._sockets.get(front)
            if socket is None:
                socket = self._sockets[front] = self.context.socket(zmq.PUSH)
                socket.setsockopt(zmq.SNDHWM, OUTBOX_MESSAGES)
                socket.connect(front)
            try:
                socket.send(data, zmq.NOBLOCK)
            except zmq.Again:  # a front end gone, its queue full: nobody waits for these
                pass

    def forget(self, front: str) -> None:
        """A front end gone: its socket closed, what was queued for it dropped."""
        with self._lock:
            socket = self._sockets.pop(front, None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for socket in self._sockets.values():
                socket.close(linger=1000)


class _Results:
    """A forward's results, held on the scheduler's thread as its units are answered, then
    sent as one message a front end (Scheduler's `answered`)."""

    def __init__(self, outbox: _Outbox):
        self._outbox, self._held = outbox, {}

    def add(self, front: str, done: Done) -> None:
        self._held.setdefault(front, []).append(done)

    def send(self) -> None:
        held, self._held = self._held, {}
        for front, done in held.items():
            self._outbox.send(front, Dones(done))


class _RemoteJob:
    """A front end's Job as this process's scheduler sees it: what it asks of a Job, its
    units' results sent back (`results`; a failure at once, by `outbox`)."""

    def __init__(self, message: Submit, results: _Results, outbox: _Outbox, forget):
        self.front, self.id, self.labels, self.kind = (message.front, message.job,
                                                       message.labels, message.kind)
        self.with_lse = message.kind == "vocab_probs"
        self._results, self._outbox, self._forget = results, outbox, forget
        self._pending, self.active = len(message.units), True

    def unit_done(self, items: range, scores: np.ndarray, prompt_tokens: int) -> None:
        self._results.add(self.front, Done(
            self.id, items.start, items.stop,
            np.ascontiguousarray(scores, np.float64).tobytes(), prompt_tokens))
        self._pending -= 1
        if self._pending == 0:
            self.settle()

    def fail(self, error: ScoreError) -> None:
        if self.active:
            self._outbox.send(self.front, Failed(self.id, error.message, error.status))
            self.settle()

    def settle(self) -> None:
        self.active = False
        self._forget(self)


def engine_process_main(spec: ReplicaSpec) -> None:
    """An engine process: its replica made on its devices, then work served until the front
    end asks it to close or is gone."""
    _see_own_devices(spec.replica, spec.engine_cfg)
    for name, value in spec.jax_settings:
        jax.config.update(name, value)
    context = zmq.Context()
    outbox = _Outbox(context)
    results = _Results(outbox)
    try:
        scheduler, dtype = _make_replica(spec, results.send)
    except Exception as e:  # the front end says why and stops
        logging.exception("replica %d could not start", spec.replica)
        outbox.send(spec.front, Ready(spec.replica, error=f"replica {spec.replica}: "
                                      f"{type(e).__name__}: {e}"))
        outbox.close()
        sys.exit(1)
    inbox = context.socket(zmq.PULL)
    inbox.bind(spec.address)
    gc.freeze()  # what start-up made (JAX's, the model's objects) is never scanned again
    outbox.send(spec.front, Ready(spec.replica, dtype, scheduler.status()))
    try:
        _serve(scheduler, inbox, outbox, results)
    finally:
        scheduler.close()
        inbox.close(linger=0)
        outbox.close()
        context.term()


def _see_own_devices(replica: int, engine_cfg: EngineConfig) -> None:
    """Before the backend starts: this replica's TPU chips or GPUs alone visible (on CPU the
    whole host's groups are made and this replica's taken: _make_replica)."""
    tp = engine_cfg.tp_size
    mine = range(replica * tp, (replica + 1) * tp)
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = listed.split(",") if listed else [str(i) for i in range(mine.stop)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i] for i in mine if i < len(gpus))
    if tp in TPU_CHIP_BOUNDS:  # JAX's recipe for TPU processes that do not communicate
        port = TPU_FIRST_PORT + replica
        os.environ.update(TPU_CHIPS_PER_PROCESS_BOUNDS=TPU_CHIP_BOUNDS[tp],
                          TPU_PROCESS_BOUNDS="1,1,1",
                          TPU_VISIBLE_CHIPS=",".join(map(str, mine)),
                          TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{port}",
                          TPU_MESH_CONTROLLER_PORT=str(port))


def _make_replica(spec: ReplicaSpec, answered) -> tuple[Scheduler, str]:
    cfg = spec.engine_cfg
    jax.config.update("jax_num_cpu_devices", cfg.tp_size * cfg.dp_size)
    devices = jax.devices()
    if devices[0].platform == "cpu":
        group = cfg.device_groups(devices)[spec.replica]
    else:  # its own devices alone are visible
        group = dataclasses.replace(cfg, dp_size=1).device_groups(devices)[0]
    cfg = cfg.resolve_dtype(spec.model_path, devices[0].platform)
    model, params, _ = load_model(spec.model_path, cfg.dtype, cfg.quantization)
    scheduler = local_replicas(model, params, cfg, [group], spec.runner_type,
                               answered=answered)[0]
    return scheduler, cfg.dtype


def _serve(scheduler: Scheduler, inbox, outbox: _Outbox, results: _Results) -> None:
    jobs: dict[tuple[str, int], _RemoteJob] = {}
    forget = lambda job: jobs.pop((job.front, job.id), None)  # noqa: E731
    parent = multiprocessing.parent_process()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        if not poller.poll(500):
            if parent is not None and not parent.is_alive():
                logging.info("the front end is gone: stopping")
                return
            continue
        message = _TO_ENGINE.decode(inbox.recv())
        if isinstance(message, Submit):
            job = jobs[message.front, message.job] = _RemoteJob(message, results, outbox,
                                                                forget)
            units = [Unit(job, Sequence(
                np.frombuffer(u.tokens, np.int32), np.frombuffer(u.bounds, np.int32),
                u.shared_len, np.frombuffer(u.score_rows, np.int32), u.cacheable, u.first_row),
                range(u.start, u.stop))
                for u in message.units]
            try:
                scheduler.submit(job, units)
            except ScoreError as e:
                job.fail(e)
        elif isinstance(message, Cancel):
            job = jobs.get((message.front, message.job))
            if job is not None:
                job.settle()
        elif _answer(scheduler, message, outbox):
            return


def _answer(scheduler: Scheduler, ask: Ask, outbox: _Outbox) -> bool:
    """Answers a front end's question; True when it asked this process to close."""
    if ask.op == "close":
        scheduler.close()
        outbox.send(ask.front, Reply(ask.ask))
        return True
    if ask.op == "status":
        reply = Reply(ask.ask, status=scheduler.status())
    elif ask.op == "flush":
        reply = Reply(ask.ask, pages=scheduler.flush_prefix_cache())
    else:
        try:
            scheduler.check_pages()
            reply = Reply(ask.ask)
        except AssertionError as e:
            reply = Reply(ask.ask, error=str(e) or "the page counts disagree")
    outbox.send(ask.front, reply)
    return False
