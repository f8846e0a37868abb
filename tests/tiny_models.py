"""Tiny random HuggingFace-format checkpoints, written from scratch for the tests."""
import dataclasses

from profiling import random_checkpoint
from runtime.engine_config import EngineConfig
from runtime.pool_size import cpu_pool_tokens

FAMILIES = {
    "llama": dict(arch="LlamaForCausalLM", bos=True, head_dim=None, tie=True, shards=1),
    "qwen2": dict(arch="Qwen2ForCausalLM", bos=False, head_dim=None, tie=False, shards=2),
    "qwen3": dict(arch="Qwen3ForCausalLM", bos=False, head_dim=24, tie=False, shards=1),
    "qwen3_cls": dict(arch="Qwen3ForSequenceClassification", bos=False, head_dim=24, tie=False,
                      shards=1),
}
WINDOW = 6  # the windowed families' sliding window: shorter than the tests' queries
WINDOWED_FAMILIES = {
    "mistral": dict(arch="MistralForCausalLM", bos=True, head_dim=None, tie=False, shards=1,
                    config=dict(model_type="mistral", sliding_window=WINDOW)),
    "gemma": dict(arch="GemmaForCausalLM", bos=True, head_dim=32, tie=True, shards=1,
                  config=dict(model_type="gemma", hidden_activation="gelu_pytorch_tanh")),
    "gemma2": dict(arch="Gemma2ForCausalLM", bos=True, head_dim=32, tie=True, shards=1,
                   config=dict(model_type="gemma2", sliding_window=WINDOW,
                               query_pre_attn_scalar=24,
                               attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                               hidden_activation="gelu_pytorch_tanh")),
    "gemma3": dict(arch="Gemma3ForCausalLM", bos=True, head_dim=32, tie=True, shards=1,
                   config=dict(model_type="gemma3_text", sliding_window=WINDOW,
                               query_pre_attn_scalar=32,
                               num_hidden_layers=3, sliding_window_pattern=3,
                               rope_theta=1e6, rope_local_base_freq=1e4,
                               rope_scaling={"rope_type": "linear", "factor": 4.0},
                               hidden_activation="gelu_pytorch_tanh")),
}
VOCAB = 320
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 96, 2
NUM_LABELS = 3


def hf_config(family: str, vocab: int = VOCAB, **overrides) -> dict:
    """config.json of a tiny `family` model; `overrides` replace its fields."""
    spec = FAMILIES.get(family) or WINDOWED_FAMILIES[family]
    cfg = {"architectures": [spec["arch"]], "vocab_size": vocab, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
           "tie_word_embeddings": spec["tie"]}
    if spec["head_dim"]:
        cfg["head_dim"] = spec["head_dim"]
    if spec["arch"].endswith("SequenceClassification"):
        cfg["num_labels"] = NUM_LABELS
    return {**cfg, **spec.get("config", {}), **overrides}


def write_checkpoint(model_dir: str, family: str, seed: int = 0, vocab: int = VOCAB,
                     **overrides) -> str:
    spec = FAMILIES.get(family) or WINDOWED_FAMILIES[family]
    return random_checkpoint.write_checkpoint(model_dir, hf_config(family, vocab, **overrides),
                                              seed, shards=spec["shards"], bos=spec["bos"])


def small_config(**overrides) -> EngineConfig:
    """The tests' engine: small budgets, compiled on demand (warm-up has its own tests). The
    pool is CPU's default on every device: on a GPU the default takes most of its memory, and
    a test process holds an engine per family."""
    cfg = EngineConfig(**{**dict(page_size=8, max_prefill_tokens=256, max_seqs=8,
                                 warmup=False), **overrides})
    return cfg if cfg.kv_cache_tokens else dataclasses.replace(
        cfg, kv_cache_tokens=cpu_pool_tokens(cfg))
