"""A float checkpoint made W8A8 at load (`--quantization int8`): its outlier activations moved
out of the way first, then each layer's linears rounded per output channel (model.params).
The residual stream is rotated (model.rotation) where the family's norms allow it; Gemma 2's
and 3's sandwich norms do not, and there SmoothQuant's factors (model.smoothing) take the
projections' outlier channels into their weights instead. Either way down's input is
multiplied by Hadamard blocks, which spread the MLP's outliers in the forward itself."""
import numpy as np

from model.config import ModelConfig, int8_config, rotatable
from model.params import quantized
from model.rotation import down_hadamard_folded, rotated
from model.smoothing import activation_absmax, calibration_tokens, smoothed, smoothing_factors
from model.tokenizer import TextTokenizer


def int8_model(cfg: ModelConfig, params: dict, tokenizer: TextTokenizer
               ) -> tuple[ModelConfig, dict]:
    """`cfg` as `int8_config` makes it, and `params` (a float model's, stacked) rotated or
    smoothed, with down's Hadamard blocks folded in, and quantized."""
    int8_cfg = int8_config(cfg)
    if rotatable(cfg):
        params = rotated(cfg, params)
    else:
        factors = smoothing_factors(cfg, params, activation_absmax(
            cfg, params, calibration_tokens(tokenizer)))
        if int8_cfg.down_hadamard:  # down's input is spread in the forward instead
            factors["down"] = np.ones_like(factors["down"])
        params = smoothed(cfg, params, factors)
    if int8_cfg.down_hadamard:
        params = down_hadamard_folded(params, int8_cfg.down_hadamard)
    return int8_cfg, quantized(params)
