import pytest

from runtime.engine import Engine, EngineConfig
from tests.numpy_decoder import NumpyDecoder
from tests.tiny_models import FAMILIES, write_checkpoint


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {f: write_checkpoint(str(root / f), f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def engines(model_dirs) -> dict[str, Engine]:
    cfg = EngineConfig(page_size=8, max_batch_tokens=256, max_seqs=8)
    return {f: Engine.from_path(d, cfg) for f, d in model_dirs.items()}


@pytest.fixture(scope="session")
def numpy_models(model_dirs) -> dict[str, NumpyDecoder]:
    return {f: NumpyDecoder(d) for f, d in model_dirs.items()}
