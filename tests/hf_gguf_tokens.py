"""transformers' tokenization of tests/gguf_checkpoint.py's Gemma GGUF vocabulary, stored once in
tests/data/hf_gguf_tokens.json, because the suite does not install transformers.

python -m tests.hf_gguf_tokens   (needs transformers: `pip install -e '.[compare]'`)
The file records the vocabulary; the test checks it is still the one the fixture writes.
"""
import json
import os
import tempfile

from tests.gguf_checkpoint import TEXTS, vocabulary, write_gguf
from tests.tiny_models import write_checkpoint

OUT = os.path.join(os.path.dirname(__file__), "data", "hf_gguf_tokens.json")
VOCAB = 384


def main() -> None:
    import transformers
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_checkpoint(os.path.join(root, "gemma3"), "gemma3", vocab=VOCAB)
        write_gguf(model_dir, os.path.join(root, "gemma3.gguf"))
        tok = AutoTokenizer.from_pretrained(root, gguf_file="gemma3.gguf")
        out = {"source": f"transformers {transformers.__version__}, AutoTokenizer of the GGUF "
                         "file (python -m tests.hf_gguf_tokens)",
               "tokens": vocabulary(VOCAB)[0], "texts": TEXTS,
               "ids": [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS],
               "start_ids": tok("", add_special_tokens=True)["input_ids"]}
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print(out["ids"])


if __name__ == "__main__":
    main()
