"""The whole model on the planned XLA path and on the Pallas kernels (TPU interpret mode)
equals the dense reference path."""
import types

import jax
import pytest

from kernels.attention_plan import BlockSizes
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from tests.assertions import assert_scores_close
from tests.conftest import small_config


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_cls"])
def test_model_on_planned_paths_equals_reference_path(model_dirs, engines, family):
    reference = Engine.from_path(model_dirs[family], small_config(attention_backend="reference"))
    interp = Engine.from_path(model_dirs[family], small_config(
        attention_backend="interpret", q_block=8, kv_block=16))
    gpu_blocks = Engine.from_path(model_dirs[family], small_config(q_block=512, kv_block=1024))
    assert engines[family].runner.backend == "xla"
    args = ("Answer Yes or No:", ["", " Paris", " the flag of Tokyo"], [3, 4, 3])
    for item_first, apply_softmax in ((False, False), (False, True), (True, False)):
        kw = dict(item_first=item_first, apply_softmax=apply_softmax)
        want = reference.score(*args, **kw).scores
        assert_scores_close(engines[family].score(*args, **kw).scores, want)
        assert_scores_close(interp.score(*args, **kw).scores, want)
        assert_scores_close(gpu_blocks.score(*args, **kw).scores, want)
    for engine in (reference, interp, gpu_blocks):
        engine.close()


def test_the_xla_loop_takes_its_block_sizes_by_platform():
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert EngineConfig().block_sizes(jax.devices("cpu")[0]) == BlockSizes(64, 128)
    assert EngineConfig().block_sizes(gpu) == BlockSizes(512, 1024)  # a GPU: few, large steps
    assert EngineConfig(q_block=32).block_sizes(gpu) == BlockSizes(32, 1024)
    with pytest.raises(ValueError, match="may not be negative"):
        EngineConfig(kv_block=-16)
