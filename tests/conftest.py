import contextlib
import io
import logging
import os

import jax
import pytest
from absl import logging as absl_logging
from jax.experimental.compilation_cache import compilation_cache

from model.config import ModelConfig
from model.loader import load_config
from runtime.engine import Engine
from server.engine_flags import default_compile_cache_dir, xla_cache_dir
from tests.numpy_decoder import NumpyDecoder
from tests.tiny_models import FAMILIES, small_config, write_checkpoint

# XLA:CPU's older fusion emitters: faster to compile (pytest_configure)
OLDER_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def pytest_configure(config):
    """Before any test module is imported, and JAX's backend with it: eight CPU devices for the
    tensor and data parallel tests. The compile tests open libtpu for a deviceless TPU topology
    (profiling.v6e.compile); libtpu allows one process at a time unless told otherwise, and the
    suite's subprocesses (servers, multi-host nodes) load it too. There is no TPU here for two
    processes to contend for. Most of the suite's time is XLA compiling the tiny models' CPU
    programs: LLVM's lowest optimization level takes a third off each compile and moves scores
    by about 1e-6 relative, far inside the tests' bounds; a program compiled for v6e gave the
    same optimized HLO with it and without. XLA:CPU's older fusion emitters (LLVM IR, not
    MLIR) compile in half the time again; the server and the benchmarks keep XLA's defaults
    (docs/correctness.md)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8"
                               + " --xla_backend_optimization_level=0"
                               + " " + OLDER_FUSION_EMITTERS).strip()
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"


def shared_dir(tmp_path_factory, name: str):
    """A directory of this run that both pytest-xdist workers share (a plain run's own)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def user_cache_dir(tmp_path_factory):
    """Servers the tests start keep their compilation cache here, not in the user's: one for
    both workers, and the tests' own engines (session_xla_cache) keep theirs in it too."""
    path, before = shared_dir(tmp_path_factory, "user_cache"), os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(path)
    yield path
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@contextlib.contextmanager
def xla_cache_in(path: str):
    """JAX's compilation cache in `path`, every program kept, while the context is open."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    for name, value in zip(names, (path, 0.0, 0)):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX opens its cache once, at the first compile
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session", autouse=True)
def session_xla_cache(user_cache_dir):
    """One compilation cache for the whole run, as a server keeps one: many tests build
    engines of the same tiny models, in both workers and in the servers they start, and a
    program compiled once is read back after that (test_runtime, test_multi_item and
    test_parallel: 413 s without, 337 s with, in one process). JAX's key for a program holds
    the cache's path, so that only a directory shared by path is shared at all. A test that
    asserts nothing compiles counts the cache's hits too."""
    with xla_cache_in(xla_cache_dir(default_compile_cache_dir())):
        yield


@pytest.fixture
def empty_xla_cache(tmp_path_factory, session_xla_cache):
    """JAX's compilation cache in a new, empty directory for this test."""
    with xla_cache_in(str(tmp_path_factory.mktemp("empty_xla_cache"))):
        yield


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {f: write_checkpoint(str(root / f), f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def engines(model_dirs) -> dict[str, Engine]:
    engines = {f: Engine.from_path(d, small_config()) for f, d in model_dirs.items()}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.fixture(scope="session")
def numpy_models(model_dirs) -> dict[str, NumpyDecoder]:
    return {f: NumpyDecoder(d) for f, d in model_dirs.items()}


@pytest.fixture(scope="session")
def embedded_config() -> ModelConfig:
    """The embedded SmolLM2's config, read from its GGUF."""
    return load_config(None)


@pytest.fixture
def access_log(caplog, monkeypatch) -> io.StringIO:
    """What servers write to absl's stream (their access log lines), absl's logger at INFO."""
    caplog.set_level(logging.INFO, logger="absl")
    stream = io.StringIO()
    monkeypatch.setattr(absl_logging.get_absl_handler().python_handler, "stream", stream)
    return stream
