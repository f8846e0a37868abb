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
VOCAB = 320
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 96, 2
NUM_LABELS = 3


def hf_config(family: str, vocab: int = VOCAB, **overrides) -> dict:
    """config.json of a tiny `family` model; `overrides` replace its fields."""
    spec = FAMILIES[family]
    cfg = {"architectures": [spec["arch"]], "vocab_size": vocab, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
           "tie_word_embeddings": spec["tie"]}
    if spec["head_dim"]:
        cfg["head_dim"] = spec["head_dim"]
    if spec["arch"].endswith("SequenceClassification"):
        cfg["num_labels"] = NUM_LABELS
    return {**cfg, **overrides}


def write_checkpoint(model_dir: str, family: str, seed: int = 0, vocab: int = VOCAB,
                     **overrides) -> str:
    spec = FAMILIES[family]
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
