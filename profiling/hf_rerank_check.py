"""Reranking against HuggingFace transformers running Qwen3-Reranker's model-card recipe, on
small random Qwen3 checkpoints: causal (softmax of yes / no) and classifiers of one and two
classes. Needs torch and transformers (`make bench-compare` installs them).

python -m profiling.hf_rerank_check
Prints each document's relevance both ways and the largest difference.
"""
import tempfile

from absl import app

from profiling.random_checkpoint import write_checkpoint
from runtime.cli_flags import parse_flags
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.rerank import BUILT_IN, QWEN3_RERANKER

QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force.", "",
             "héllo wörld, 世界 🙂"]
CONFIG = {"model_type": "qwen3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 24, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 1024, "tie_word_embeddings": False}


def hf_relevance(model_dir: str, classes: int) -> list[float]:
    """The model card's code path: prefix ids + tokenizer(body) + suffix ids, last logits."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
    )
    t = BUILT_IN[QWEN3_RERANKER]
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json")
    kind = AutoModelForSequenceClassification if classes else AutoModelForCausalLM
    model = kind.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix, suffix = (tok.encode(s[0], add_special_tokens=False) for s in (t.prefix, t.suffix))
    out = []
    for doc in DOCUMENTS:
        body = f"<Instruct>: {t.default_instruct}\n<Query>: {QUERY}\n<Document>: {doc}"
        with torch.no_grad():
            logits = model(torch.tensor([prefix + tok(body)["input_ids"] + suffix])).logits
        z = logits[0, -1] if not classes else logits[0]
        if not classes:
            yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
            out.append(torch.softmax(torch.stack([z[yes], z[no]]), 0)[0].item())
        else:
            out.append(torch.sigmoid(z[0]).item() if classes == 1 else
                       torch.softmax(z, 0)[1].item())
    return out


def main(argv) -> None:
    del argv
    worst = 0.0
    for classes in (0, 1, 2):
        arch = "Qwen3ForSequenceClassification" if classes else "Qwen3ForCausalLM"
        hf = {**CONFIG, "architectures": [arch], **({"num_labels": classes} if classes else {})}
        model_dir = write_checkpoint(tempfile.mkdtemp(), hf, seed=7)
        engine = Engine.from_path(model_dir, EngineConfig(max_prefill_tokens=512, page_size=8,
                                                          warmup=False))
        ours = dict(engine.rerank(QUERY, DOCUMENTS).ranking)
        engine.close()
        for k, ref in enumerate(hf_relevance(model_dir, classes)):
            worst = max(worst, abs(ref - ours[k]))
            print(f"{arch} {classes or ''} document {k}: transformers {ref:.7f}, "
                  f"jax-score {ours[k]:.7f}")
    print(f"max abs difference {worst:.1e}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
