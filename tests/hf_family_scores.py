"""HuggingFace transformers' own scores for the tiny windowed-family checkpoints of
tests/test_families.py, each item scored alone (query, then the item), eager attention, float32:
stored once in tests/data/hf_family_scores.json, because the suite does not install torch.

python -m tests.hf_family_scores   (needs torch and transformers: `pip install -e '.[compare]'`)
The file records each checkpoint's weight checksum; the test rewrites the checkpoints from the
same seeds and checks it first.
"""
import json
import os
import tempfile

import numpy as np

from tests.tiny_models import WINDOW, WINDOWED_FAMILIES, write_checkpoint

OUT = os.path.join(os.path.dirname(__file__), "data", "hf_family_scores.json")
SEED = 20
QUERY_LEN, ITEM_LENS, LABELS = 2 * WINDOW + 1, (1, 5, 0, 9, 3), [0, 7, 319]


def checkpoint(root: str, family: str) -> str:
    return write_checkpoint(os.path.join(root, family), family,
                            seed=SEED + list(WINDOWED_FAMILIES).index(family))


def request(vocab: int = 320):
    rng = np.random.default_rng(SEED)
    return (rng.integers(0, vocab, QUERY_LEN).tolist(),
            [rng.integers(0, vocab, n).tolist() for n in ITEM_LENS])


def checksum(model_dir: str) -> float:
    from safetensors.numpy import load_file
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    return float(sum(np.abs(t.astype(np.float64)).sum() for t in tensors.values()))


def hf_scores(model_dir: str, query, items) -> dict:
    """Label logits and the logsumexp over the vocabulary at each item's last token."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    logits, lse = [], []
    for item in items:
        with torch.no_grad():
            z = model(torch.tensor([query + item])).logits[0, -1].double()
        logits.append(z[LABELS].tolist())
        lse.append(torch.logsumexp(z, 0).item())
    return {"label_logits": logits, "logsumexp": lse}


def main() -> None:
    import transformers
    query, items = request()
    out = {"source": f"transformers {transformers.__version__}, eager attention, float32, "
                     "each item alone (python -m tests.hf_family_scores)",
           "query": query, "items": items, "labels": LABELS, "families": {}}
    with tempfile.TemporaryDirectory() as root:
        for family in WINDOWED_FAMILIES:
            model_dir = checkpoint(root, family)
            out["families"][family] = {"checksum": checksum(model_dir),
                                       **hf_scores(model_dir, query, items)}
            print(family, out["families"][family]["logsumexp"])
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
