"""Model configuration parsed once from a HuggingFace `config.json` (or GGUF metadata)."""
import dataclasses
import json
import os

_FAMILIES = {"LlamaFor": "llama", "Qwen2For": "qwen2", "Qwen3For": "qwen3"}
_HEADS = ("CausalLM", "SequenceClassification")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
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

    def __post_init__(self):
        if self.family not in _FAMILIES.values():
            raise ValueError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def output_size(self) -> int:
        """Rows of the output head: the vocabulary, or the classes of a classifier."""
        return self.num_labels if self.is_classifier else self.vocab_size


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
    if raw.get("rope_scaling") not in (None, {}):
        raise ValueError(f"rope_scaling {raw['rope_scaling']!r} is not supported")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        num_labels=_num_labels(raw) if is_classifier else 0,
    )


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
