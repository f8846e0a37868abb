"""python -m server --model-path PATH --host H --port P --dtype D

Flags may be spelled as in SGLang (--model-path) or as in absl (--model_path); --help lists them.
"""
import asyncio
import glob
import os

import jax
from absl import app, flags, logging

from model.loader import embedded_model_path
from runtime.cli_flags import parse_flags
from runtime.model_runner import ModelRunner
from server import engine_flags
from server.access import ADMIN_SETTINGS, AccessPolicy, admin_routes_open
from server.app import ServerConfig, serve
from server.engine_flags import (
    define_engine_flags,
    engine_config,
    served_model_name,
    start_engine,
    use_compile_cache,
)
from server.http import Limits

FLAGS = flags.FLAGS
API_KEY_ENV = "JAX_SCORE_API_KEY"  # the key without it showing in `ps`
_DEVICE_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*",  # TPU chips, as libtpu finds them
                 "/dev/nvidia[0-9]*", "/dev/kfd")          # NVIDIA and AMD GPUs


def auto_api_workers(replicas: int, cores: int, accelerator: bool) -> int:
    """--api-workers auto: 1 (this process alone, no IPC) on CPU devices, whose forward is the
    bound, not the host path; with accelerators, two front ends a replica as far as the cores
    go (a front end is one interpreter, about a core; a v6e chip at full pace takes 1-2.3
    cores of front-end work: docs/host_path.md)."""
    return max(1, min(2 * replicas, cores)) if accelerator else 1


def has_accelerator(platforms: str) -> bool:
    """Whether JAX will find a TPU or GPU, without starting its backends (the engine
    processes will own the devices): `platforms` (JAX_PLATFORMS) if set, else the devices'
    files."""
    if platforms:
        return platforms.split(",")[0] != "cpu"
    return any(glob.glob(pattern) for pattern in _DEVICE_FILES)


def define_server_flags() -> None:
    flags.DEFINE_string("host", "127.0.0.1", "address to bind")
    flags.DEFINE_integer("port", 30000, "port to bind")
    flags.DEFINE_integer("max_body_bytes", 8 << 20, "largest request body (413 beyond)")
    flags.DEFINE_integer("max_head_bytes", 64 << 10, "largest request line and headers "
                         "(431 beyond)")
    flags.DEFINE_float("header_timeout_s", 10.0, "time to send a request head (408 beyond)")
    flags.DEFINE_float("body_timeout_s", 30.0, "time to send a request body (408 beyond)")
    flags.DEFINE_float("send_timeout_s", 30.0, "time a client may take to read its response")
    flags.DEFINE_float("idle_timeout_s", 75.0, "keep-alive connection idle time before closing")
    flags.DEFINE_integer("max_connections", 1024, "open connections (503 beyond)")
    flags.DEFINE_integer("max_pending", 256, "score requests queued or running (503 beyond)")
    flags.DEFINE_bool("access_log", True, "log a line per request")
    flags.DEFINE_string("api_key", None, "every route but GET /health needs 'Authorization: "
                        f"Bearer KEY'; also read from ${API_KEY_ENV}; default: no key")
    flags.DEFINE_bool("metrics_without_key", False, "GET /metrics answers without the API key")
    flags.DEFINE_enum("admin_routes", "auto", list(ADMIN_SETTINGS), "POST /flush_cache, "
                      "/start_profile and /stop_profile; auto: on when --host is a loopback "
                      "address or an API key is set, else off")
    flags.DEFINE_string("trace_dir", None, "where POST /start_profile writes jax.profiler "
                        "traces (view with TensorBoard); default: a new temporary directory")
    flags.DEFINE_float("grace_s", 30.0, "on SIGTERM/SIGINT, how long requests in flight may "
                       "take to finish")
    flags.DEFINE_string("api_workers", "auto", "front-end processes sharing the port, each "
                        "parsing, tokenizing and packing requests for the engine processes "
                        "(vLLM's --api-server-count); 1: this process alone; auto: 1 on CPU "
                        "devices, else 2 a replica up to the host's cores")


def server_config() -> ServerConfig:
    limits = Limits(max_head_bytes=FLAGS.max_head_bytes, max_body_bytes=FLAGS.max_body_bytes,
                    idle_timeout_s=FLAGS.idle_timeout_s, header_timeout_s=FLAGS.header_timeout_s,
                    body_timeout_s=FLAGS.body_timeout_s, send_timeout_s=FLAGS.send_timeout_s)
    return ServerConfig(model_name=served_model_name(),
                        model_path=FLAGS.model_path or embedded_model_path(), limits=limits,
                        max_connections=FLAGS.max_connections, max_pending=FLAGS.max_pending,
                        access_log=FLAGS.access_log, trace_dir=FLAGS.trace_dir,
                        access=access_policy())


def access_policy() -> AccessPolicy:
    """A key given but empty (an unset shell variable) is an error, not a server without one."""
    key = FLAGS.api_key if FLAGS.api_key is not None else os.environ.get(API_KEY_ENV)
    try:
        return AccessPolicy(api_key=key, metrics_without_key=FLAGS.metrics_without_key,
                            admin_routes=admin_routes_open(FLAGS.admin_routes, FLAGS.host, key))
    except ValueError as e:
        raise app.UsageError(f"--api-key / ${API_KEY_ENV}: {e}") from None


def api_workers() -> int:
    """--api-workers, `auto` resolved (to 1 where the processes extra is not installed)."""
    if FLAGS.api_workers == "auto":
        workers = 1 if FLAGS.nnodes > 1 else auto_api_workers(
            FLAGS.dp_size, os.cpu_count() or 1, has_accelerator(jax.config.jax_platforms or ""))
        if workers > 1 and not _has_processes_extra():
            logging.warning("--api-workers auto: one front end, not %d: pip install "
                            "'jax-score[processes]' for more", workers)
            return 1
        return workers
    try:
        workers = int(FLAGS.api_workers)
    except ValueError:
        workers = 0
    if workers < 1:
        raise app.UsageError(f"--api-workers must be auto or an integer >= 1, got "
                             f"{FLAGS.api_workers!r}")
    if workers > 1 and FLAGS.nnodes > 1:
        raise app.UsageError("--api-workers > 1 serves one host: --nnodes 1")
    if workers > 1 and not _has_processes_extra():
        raise app.UsageError("--api-workers > 1 needs pyzmq and msgspec: pip install "
                             "'jax-score[processes]'")
    return workers


def _has_processes_extra() -> bool:
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


def run(runner_type=ModelRunner) -> None:
    """The server of the parsed flags until SIGTERM; `runner_type`: as Engine's."""
    config = server_config()  # a bad flag fails before the model loads
    workers = api_workers()
    if workers > 1:
        from server.api_workers import APIWorkerSpec, serve_with_api_workers
        use_compile_cache(FLAGS.compile_cache_dir)
        serve_with_api_workers(FLAGS.model_path, engine_config(), runner_type,
                               APIWorkerSpec(config, FLAGS.host, FLAGS.port, FLAGS.grace_s),
                               workers)
        return
    engine = start_engine(runner_type)
    try:
        if FLAGS.node_rank:
            logging.info("node %d: running node 0's forwards", FLAGS.node_rank)
            logging.info("node 0 stopped after %d forwards", engine.follow())
        else:
            asyncio.run(serve(engine, config, FLAGS.host, FLAGS.port, FLAGS.grace_s))
    finally:
        engine.close()


def main(argv) -> None:
    del argv
    run()


if __name__ == "__main__":
    define_engine_flags()
    define_server_flags()
    flags.adopt_module_key_flags(engine_flags)  # --help lists them too
    app.run(main, flags_parser=parse_flags)
