"""The whole model on the Pallas kernels (TPU interpret mode) equals the reference path."""
import pytest

from runtime.engine import Engine, EngineConfig
from tests.assertions import assert_scores_close


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_cls"])
def test_model_in_interpret_mode_equals_reference_path(model_dirs, engines, family):
    interp = Engine.from_path(model_dirs[family], EngineConfig(
        page_size=8, max_batch_tokens=256, max_seqs=8, attention_backend="interpret",
        q_block=8, kv_block=16))
    assert interp.backend == "interpret" and engines[family].backend == "reference"
    args = ("Answer Yes or No:", ["", " Paris", " the flag of Tokyo"], [3, 4, 3])
    for item_first, apply_softmax in ((False, False), (False, True), (True, False)):
        kw = dict(item_first=item_first, apply_softmax=apply_softmax)
        want = engines[family].score(*args, **kw).scores
        assert_scores_close(interp.score(*args, **kw).scores, want)
