import os

import pytest

from runtime.engine import Engine
from tests.numpy_decoder import NumpyDecoder
from tests.tiny_models import FAMILIES, small_config, write_checkpoint


def pytest_configure(config):
    """Before any test module is imported, and JAX's backend with it: eight CPU devices for the
    tensor and data parallel tests. The compile tests open libtpu for a deviceless TPU topology
    (profiling.tpu_compile); libtpu allows one process at a time unless told otherwise, and the
    suite's subprocesses (servers, multi-host nodes) load it too. There is no TPU here for two
    processes to contend for."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"


@pytest.fixture(scope="session", autouse=True)
def user_cache_dir(tmp_path_factory):
    """Servers the tests start keep their compilation cache here, not in the user's."""
    path, before = tmp_path_factory.mktemp("user_cache"), os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(path)
    yield path
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


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
