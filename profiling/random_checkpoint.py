"""HuggingFace-format checkpoints of random weights: for timing a model of a real size where no
model hub can be reached, and for the tests' tiny models.

python -m profiling.random_checkpoint --model Qwen3-0.6B --out DIR [--seed 0]

Writes config.json, model.safetensors (float32) and a small byte-level BPE tokenizer.json
(with ChatML's <|im_start|> and <|im_end|> special, and "yes" and "no" single tokens, so that
the built-in rerank template fits it).
Weights are normal with standard deviation `std` (embeddings 5x, output heads 2.5x), norms
near 1: activations stay in range through many layers, in bfloat16 too.
"""
import json
import os

import numpy as np
import tokenizers
from absl import app, flags
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from model.config import ModelConfig
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS
CORPUS = ["The capital of France is Paris.", "I pledge allegiance to the flag.",
          "Tokyo is a city in Japan.", "Answer Yes or No for each option:",
          "scoring many items with one query", "héllo wörld, 世界 🙂 123 456",
          *["yes", "no"] * 3] * 4
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                  "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPES = {"gemma3": "gemma3_text"}


def config_json(cfg: ModelConfig) -> dict:
    """The config.json of a causal LM sized as `cfg`."""
    if cfg.is_classifier or cfg.o_bias or cfg.qkv_bias != (cfg.family == "qwen2"):
        raise ValueError(f"a plain causal LM of its family, not {cfg}")
    hf = {"architectures": [_ARCHITECTURES[cfg.family]],
          "model_type": _MODEL_TYPES.get(cfg.family, cfg.family),
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
          "max_position_embeddings": cfg.max_context,
          "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.activation == "gelu_tanh":
        hf["hidden_activation"] = "gelu_pytorch_tanh"
    if cfg.query_scale:
        hf["query_pre_attn_scalar"] = cfg.query_scale
    if cfg.attn_softcap or cfg.final_softcap:
        hf.update(attn_logit_softcapping=cfg.attn_softcap or None,
                  final_logit_softcapping=cfg.final_softcap or None)
    if cfg.rope_factor != 1.0:
        hf["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.windowed:
        hf.update(sliding_window=max(cfg.layer_windows), layer_types=[
            "sliding_attention" if w else "full_attention" for w in cfg.layer_windows])
        if cfg.local_rope_theta:
            hf["rope_local_base_freq"] = cfg.local_rope_theta
    return hf


def random_tensors(hf: dict, seed: int, std: float) -> dict[str, np.ndarray]:
    """Every tensor a checkpoint with config.json `hf` holds."""
    rng = np.random.default_rng(seed)
    h, v = hf["hidden_size"], hf["vocab_size"]
    d = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv, i = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d, hf["intermediate_size"]
    arch = hf["architectures"][0]
    gemma = arch.startswith("Gemma")
    w = lambda *shape, s=std: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    center = 0.0 if gemma else 1.0  # Gemma's norms scale by 1 + w
    norm = lambda n: (center + rng.standard_normal(n) * 0.1).astype(np.float32)  # noqa: E731
    embed_std = 5 * std / (np.sqrt(h) if gemma else 1.0)  # Gemma scales them by sqrt(hidden)
    t = {"model.embed_tokens.weight": w(v, h, s=embed_std), "model.norm.weight": norm(h)}
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if arch.startswith(("Gemma2", "Gemma3")):
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        t.update({p + f"{n}.weight": norm(h) for n in norms})
        t.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                  p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                  p + "mlp.down_proj.weight": w(h, i)})
        if arch.startswith("Qwen2"):
            t.update({p + f"self_attn.{x}_proj.bias": w(n)
                      for x, n in (("q", q), ("k", kv), ("v", kv))})
        if arch.startswith(("Qwen3", "Gemma3")):
            t.update({p + "self_attn.q_norm.weight": norm(d),
                      p + "self_attn.k_norm.weight": norm(d)})
    if arch.endswith("SequenceClassification"):
        t["score.weight"] = w(hf["num_labels"], h, s=2.5 * std)
    elif not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, h, s=2.5 * std)
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


def write_tokenizer(path: str, bos: bool) -> None:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(path)


def write_checkpoint(model_dir: str, hf: dict, seed: int = 0, std: float = 0.2,
                     shards: int = 1, bos: bool = False) -> str:
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    save_tensors(model_dir, random_tensors(hf, seed, std), shards)
    write_tokenizer(os.path.join(model_dir, "tokenizer.json"), bos)
    return model_dir


def main(argv) -> None:
    del argv
    from profiling.v6e.compile import SIZED_MODELS, WINDOWED_MODELS
    sizes = {**SIZED_MODELS, **WINDOWED_MODELS}
    if FLAGS.model not in sizes:
        raise app.UsageError(f"--model {FLAGS.model!r} is not one of {list(sizes)}")
    print(write_checkpoint(FLAGS.out, config_json(sizes[FLAGS.model]), FLAGS.seed, std=0.02))


if __name__ == "__main__":
    flags.DEFINE_string("model", "Qwen3-0.6B", "a size of profiling.v6e.compile.SIZED_MODELS "
                        "or WINDOWED_MODELS")
    flags.DEFINE_string("out", None, "checkpoint directory to write", required=True)
    flags.DEFINE_integer("seed", 0, "random seed of the weights")
    app.run(main, flags_parser=parse_flags)
