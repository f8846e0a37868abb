"""Loads a HuggingFace checkpoint directory: config.json, safetensors, tokenizer.json."""
import json
import os

from safetensors import safe_open

from model.config import ModelConfig, load_hf_config
from model.params import build_params
from model.tokenizer import TextTokenizer

_INDEX = "model.safetensors.index.json"


def safetensor_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
    else:
        files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir)
                       if n.endswith(".safetensors"))
    missing = [p for p in files if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"missing safetensors shards: {missing}")
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


class _TensorSource:
    """Name -> numpy array over several safetensors files, opened lazily."""

    def __init__(self, files: list[str]):
        self._handles = [safe_open(p, framework="numpy") for p in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __call__(self, name: str):
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self._where[name].get_tensor(name)


def load_hf_model(model_dir: str, dtype) -> tuple[ModelConfig, dict, TextTokenizer]:
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model path {model_dir!r} is not a directory")
    cfg = load_hf_config(model_dir)
    params = build_params(cfg, _TensorSource(safetensor_files(model_dir)), dtype)
    tokenizer = TextTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return cfg, params, tokenizer
