"""The whole model on the planned XLA path and on the Pallas kernels (TPU interpret mode)
equals the dense reference path."""
import pytest

from runtime.engine import Engine
from tests.assertions import assert_scores_close
from tests.conftest import small_config


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_cls"])
def test_model_on_planned_paths_equals_reference_path(model_dirs, engines, family):
    reference = Engine.from_path(model_dirs[family], small_config(attention_backend="reference"))
    interp = Engine.from_path(model_dirs[family], small_config(
        attention_backend="interpret", q_block=8, kv_block=16))
    assert engines[family].runner.backend == "xla"
    args = ("Answer Yes or No:", ["", " Paris", " the flag of Tokyo"], [3, 4, 3])
    for item_first, apply_softmax in ((False, False), (False, True), (True, False)):
        kw = dict(item_first=item_first, apply_softmax=apply_softmax)
        want = reference.score(*args, **kw).scores
        assert_scores_close(engines[family].score(*args, **kw).scores, want)
        assert_scores_close(interp.score(*args, **kw).scores, want)
    reference.close()
    interp.close()
