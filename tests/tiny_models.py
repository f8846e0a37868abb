"""Tiny random HuggingFace-format checkpoints, written from scratch for the tests."""
import json
import os

import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CORPUS = ["The capital of France is Paris.", "I pledge allegiance to the flag.",
          "Tokyo is a city in Japan.", "Answer Yes or No for each option:",
          "scoring many items with one query", "héllo wörld, 世界 🙂 123 456"] * 4

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


def write_tokenizer(path: str, bos: bool) -> None:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(path)


def hf_config(family: str, vocab: int = VOCAB) -> dict:
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
    return cfg


def random_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    arch = cfg["architectures"][0]
    w = lambda *shape, s=0.2: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(v, h, s=1.0), "model.norm.weight": norm(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                  p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                  p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                  p + "mlp.down_proj.weight": w(h, i)})
        if arch.startswith("Qwen2"):
            t.update({p + f"self_attn.{x}_proj.bias": w(n) for x, n in (("q", q), ("k", kv), ("v", kv))})
        if arch.startswith("Qwen3"):
            t.update({p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)})
    if arch.endswith("SequenceClassification"):
        t["score.weight"] = w(cfg["num_labels"], h, s=0.5)
    elif not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, h, s=0.5)
    return t


def save_tensors(model_dir: str, tensors: dict, shards: int) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(model_dir, "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(model_dir, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def write_checkpoint(model_dir: str, family: str, seed: int = 0, vocab: int = VOCAB) -> str:
    os.makedirs(model_dir, exist_ok=True)
    cfg = hf_config(family, vocab)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_tensors(model_dir, random_tensors(cfg, seed), FAMILIES[family]["shards"])
    write_tokenizer(os.path.join(model_dir, "tokenizer.json"), FAMILIES[family]["bos"])
    return model_dir
