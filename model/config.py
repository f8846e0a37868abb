"""Model configuration parsed once from a HuggingFace `config.json` (or GGUF metadata).

A family is data: what sets Gemma, Gemma 2, Gemma 3 and Mistral apart from Llama (the norms'
offset, the embedding's scale, the MLP's activation, the norms around each sublayer, the
soft-caps, the attention scale, each layer's window and RoPE) are fields the decoder reads,
as transformers' modeling files compute them."""
import dataclasses
import json
import math
import os

_FAMILIES = {"LlamaFor": "llama", "Qwen2For": "qwen2", "Qwen3For": "qwen3",
             "MistralFor": "mistral", "GemmaFor": "gemma", "Gemma2For": "gemma2",
             "Gemma3For": "gemma3"}
_HEADS = ("CausalLM", "SequenceClassification")
_GEMMAS = ("gemma", "gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
NO_WINDOW = 0  # a layer's window: every earlier key (`ModelConfig.layer_windows`)
QUANTIZATIONS = ("", "int8")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3" | "mistral" | "gemma" | "gemma2" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    num_labels: int = 0  # > 0 for *ForSequenceClassification
    qk_norm: bool | None = None    # q's and k's heads RMS-normed before RoPE; None: the
    #                                family's (Qwen3's, Gemma 3's)
    norm_offset: float = 0.0       # RMSNorm scales by (offset + w): Gemma's 1 (folded on load)
    embed_scale: bool = False      # embeddings times sqrt(hidden), in the activations' dtype
    activation: str = "silu"       # of the gated MLP: "silu", or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False   # the attention's and the MLP's outputs normed before their
    #                                residual adds (Gemma 2, 3: four norms a layer)
    attn_softcap: float = 0.0      # attention scores cap * tanh(s / cap) before the mask; 0: none
    final_softcap: float = 0.0     # the head's logits capped so, before any softmax; 0: none
    query_scale: float = 0.0       # scores scaled by query_scale ** -0.5; 0: head_dim's
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window W (key k seen from q
    #                                      iff q - k < W, by logical position), NO_WINDOW: all;
    #                                      () : no layer has one
    local_rope_theta: float = 0.0  # RoPE base of the windowed layers, unscaled (Gemma 3's);
    #                                0: theirs is the other layers' (rope_theta, rope_factor)
    rope_factor: float = 1.0       # linear RoPE scaling (positions / factor)
    quantization: str = ""         # "int8": W8A8, the layers' projections and MLP in int8
    #                                (kernels.int8); "": none
    down_hadamard: int = 0         # down's input times hadamard(n) in each run of n features
    #                                (kernels.int8.hadamard_blocks); 0: none

    def __post_init__(self):
        if self.family not in _FAMILIES.values():
            raise ValueError(f"unknown model family {self.family!r}")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.family in ("qwen3", "gemma3"))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers
                                   or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows {self.layer_windows} must give each of "
                             f"{self.num_layers} layers a window >= 0")
        for name in ("attn_softcap", "final_softcap", "query_scale", "local_rope_theta"):
            if getattr(self, name) < 0:
                raise ValueError(f"config {name} must not be negative, got {getattr(self, name)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.down_hadamard < 0 or self.down_hadamard & (self.down_hadamard - 1) or (
                self.down_hadamard and self.intermediate_size % self.down_hadamard):
            raise ValueError(f"down_hadamard must be 0 or a power of 2 dividing intermediate_size"
                             f"={self.intermediate_size}, got {self.down_hadamard}")
        if self.rope_factor <= 0:
            raise ValueError(f"rope_factor must be positive, got {self.rope_factor}")

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def sm_scale(self) -> float:
        """What attention scores are scaled by."""
        return (self.query_scale or self.head_dim) ** -0.5

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)

    @property
    def local_rope(self) -> bool:
        """Whether windowed layers rotate by other RoPE tables than the rest."""
        return self.windowed and self.local_rope_theta > 0

    @property
    def output_size(self) -> int:
        """Rows of the output head: the vocabulary, or the classes of a classifier."""
        return self.num_labels if self.is_classifier else self.vocab_size


HADAMARD_BLOCK = 128  # features: a TPU lane tile


def rotatable(cfg: ModelConfig) -> bool:
    """Whether the residual stream can be rotated (model.rotation): its norms all before the
    sublayers (not Gemma 2's and 3's sandwich norms, which a rotation does not commute with)."""
    return not cfg.sandwich_norms


def int8_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` quantized at load (model.quantize): W8A8; where the residual stream is rotated,
    a head of its own (a tied embedding's rotated copy: model.rotation); down's input times
    Hadamard blocks of the largest power of 2 up to HADAMARD_BLOCK features that divides the
    MLP's width."""
    block = math.gcd(cfg.intermediate_size, HADAMARD_BLOCK)
    return dataclasses.replace(
        cfg, quantization="int8", down_hadamard=block if block > 1 else 0,
        tie_word_embeddings=cfg.tie_word_embeddings and not rotatable(cfg))


def parse_architecture(architectures) -> tuple[str, bool]:
    """Returns (family, is_classifier) for e.g. ["Qwen3ForSequenceClassification"]."""
    for arch in architectures or ():
        for prefix, family in _FAMILIES.items():
            if arch.startswith(prefix) and arch[len(prefix):] in _HEADS:
                return family, arch.endswith("SequenceClassification")
    raise ValueError(f"unsupported architectures {architectures!r}; supported: "
                     + ", ".join(p + h for p in _FAMILIES for h in _HEADS))


def config_from_hf(raw: dict) -> ModelConfig:
    family, is_classifier = parse_architecture(raw.get("architectures"))
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    layers = raw["num_hidden_layers"]
    windows = _layer_windows(raw, family, layers)
    global_rope, local_rope = _ropes(raw, family)
    return ModelConfig(
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rope_theta=global_rope[0],
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family in _GEMMAS)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        num_labels=_num_labels(raw) if is_classifier else 0,
        norm_offset=1.0 if family in _GEMMAS else 0.0,
        embed_scale=family in _GEMMAS,
        activation=_activation(raw, family),
        sandwich_norms=family in ("gemma2", "gemma3"),
        attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        query_scale=float(raw.get("query_pre_attn_scalar") or 0.0) if family in _GEMMAS else 0.0,
        layer_windows=windows,
        local_rope_theta=_local_rope_theta(family, windows, global_rope, local_rope),
        rope_factor=global_rope[1],
        quantization=_quantization(raw.get("quantization_config")),
    )


_W8A8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                 "dynamic": False}
_W8A8_TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                "dynamic": True}


def _quantization(config: dict | None) -> str:
    """"int8" for a compressed-tensors W8A8 checkpoint as llm-compressor writes it (int8
    weights with per-channel scales, activations per token, dynamically; every Linear but
    lm_head), "" for none; any other quantization_config is refused, naming what differs."""
    if not config:
        return ""
    method = config.get("quant_method", "unnamed")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config {method!r} is not supported: give a 16- or "
                         "32-bit checkpoint (--quantization int8 quantizes it at load) or a "
                         "compressed-tensors W8A8 one")
    groups = list((config.get("config_groups") or {}).values())
    checks = {"format": config.get("format") == "int-quantized",
              "config_groups": len(groups) == 1 and groups[0].get("targets") == ["Linear"],
              "weights": bool(groups) and _has(groups[0].get("weights"), _W8A8_WEIGHTS),
              "input_activations": bool(groups) and _has(groups[0].get("input_activations"),
                                                         _W8A8_TOKENS),
              "ignore": set(config.get("ignore") or ()) <= {"lm_head"}}
    wrong = [name for name, ok in checks.items() if not ok]
    if wrong:
        raise ValueError(f"quantization_config compressed-tensors: only W8A8 int8 (weights "
                         f"per channel, activations per token, dynamic) is supported; its "
                         f"{', '.join(wrong)} differ")
    return "int8"


def _has(scheme: dict | None, wanted: dict) -> bool:
    return scheme is not None and all(scheme.get(k) == v for k, v in wanted.items()) and (
        scheme.get("group_size") is None)


def _activation(raw: dict, family: str) -> str:
    name = raw.get("hidden_activation") or raw.get("hidden_act") or (
        "gelu_pytorch_tanh" if family in _GEMMAS else "silu")
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: "
                         f"{sorted(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]


_SLIDING, _FULL = "sliding_attention", "full_attention"


def _layer_windows(raw: dict, family: str, layers: int) -> tuple[int, ...]:
    """Each layer's window: Mistral's on every layer, Gemma 2's on even layers, Gemma 3's on
    five of six, unless `layer_types` says which (transformers 5)."""
    window = raw.get("sliding_window")
    if family not in ("mistral", "gemma2", "gemma3") or not window:
        if raw.get("use_sliding_window") and family in ("qwen2", "qwen3"):
            raise ValueError("use_sliding_window=true is not supported for "
                             f"{family} (its max_window_layers rule)")
        return ()
    if "layer_types" in raw:
        kinds = raw["layer_types"]
        unknown = set(kinds) - {_SLIDING, _FULL}
        if unknown or len(kinds) != layers:
            raise ValueError(f"layer_types {kinds!r}: {layers} of {_SLIDING!r} or {_FULL!r}")
    elif family == "gemma2":
        kinds = [_SLIDING if i % 2 == 0 else _FULL for i in range(layers)]
    elif family == "gemma3":
        pattern = int(raw.get("sliding_window_pattern", 6))
        kinds = [_FULL if (i + 1) % pattern == 0 else _SLIDING for i in range(layers)]
    else:
        kinds = [_SLIDING] * layers
    return tuple(int(window) if kind == _SLIDING else NO_WINDOW for kind in kinds)


def _local_rope_theta(family: str, windows: tuple, full: tuple, local: tuple) -> float:
    """Gemma 3's windowed layers rotate by their own base, unscaled; another family's by the
    full layers' RoPE (a config that says otherwise is refused)."""
    if not any(windows):
        return 0.0
    if family == "gemma3":
        if local[1] != 1.0:
            raise ValueError("rope_parameters: scaling of sliding_attention layers is not "
                             "supported")
        return local[0]
    if local != full:
        raise ValueError(f"rope_parameters: {family}'s layer types rotate alike here; "
                         f"sliding {local} and full {full} differ")
    return 0.0


def _ropes(raw: dict, family: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(theta, linear factor) of the full-attention layers and of the windowed ones: from
    `rope_parameters` per layer type (transformers 5), or `rope_theta`, `rope_scaling` (every
    layer's, but Gemma 3's windowed ones) and Gemma 3's `rope_local_base_freq`."""
    params = raw.get("rope_parameters")
    if params and _FULL in params:
        full, local = params[_FULL], params.get(_SLIDING, params[_FULL])
    else:
        scaling = raw.get("rope_scaling") or (params if params and "rope_type" in params
                                              else None)
        full = {"rope_theta": raw.get("rope_theta", (params or {}).get("rope_theta", 10000.0)),
                **(scaling or {})}
        local = ({"rope_theta": raw.get("rope_local_base_freq", full["rope_theta"])}
                 if family == "gemma3" else full)
    return _rope(full), _rope(local)


def _rope(params: dict) -> tuple[float, float]:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported (default, linear)")
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    theta = float(params.get("rope_theta", 10000.0))
    if not math.isfinite(theta) or theta <= 0 or factor <= 0:
        raise ValueError(f"rope parameters {params!r}: theta and factor must be positive")
    return theta, factor


def _num_labels(raw: dict) -> int:
    if "num_labels" in raw:
        return int(raw["num_labels"])
    if "id2label" in raw:
        return len(raw["id2label"])
    raise ValueError("a SequenceClassification config needs num_labels or id2label")


def load_hf_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir}")
    with open(path) as f:
        return config_from_hf(json.load(f))
