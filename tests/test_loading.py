"""Checkpoint loading: the happy paths and the clear errors."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model.config import config_from_hf
from model.loader import checkpoint_dtype, load_config, load_model
from model.params import KV_GROUP, grouped_kv, grouped_kv_shapes, param_shapes
from model.sharding import repeat_kv_heads, repeat_kv_shapes
from tests.tiny_models import FAMILIES, hf_config


def copy_of(model_dirs, family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(model_dirs[family], dst)
    return str(dst)


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_from_the_config_alone_are_the_loaded_ones(model_dirs, family):
    """What the deviceless compile checks build programs from (no weights) is what loads."""
    cfg, params, _ = load_model(model_dirs[family])
    assert load_config(model_dirs[family]) == cfg
    shapes = lambda tree: jax.tree.map(np.shape, tree)  # noqa: E731
    assert shapes(params) == param_shapes(cfg)
    assert shapes(repeat_kv_heads(params, cfg, 2)) == repeat_kv_shapes(param_shapes(cfg), 2)
    grouped = grouped_kv(params)
    assert shapes(grouped) == grouped_kv_shapes(param_shapes(cfg))
    for i, name in enumerate(("wk", "wv")):  # the TPU kernels' k and v weights, one stack
        np.testing.assert_array_equal(grouped["layers"][KV_GROUP][:, i], params["layers"][name])


def test_embedded_config_without_its_weights():
    cfg = load_config(None)
    assert (cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == (49152, 30, 9, 64)


def test_sharded_checkpoint_loads(model_dirs):
    assert os.path.isfile(os.path.join(model_dirs["qwen2"], "model.safetensors.index.json"))
    cfg, params, _ = load_model(model_dirs["qwen2"])
    assert cfg.qkv_bias and "bq" in params["layers"] and "head" in params


def test_config_fields():
    cfg = config_from_hf(hf_config("qwen3"))
    assert (cfg.family, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", 24, True, False)
    cls = config_from_hf(hf_config("qwen3_cls"))
    assert cls.is_classifier and cls.output_size == 3
    assert config_from_hf(hf_config("llama")).tie_word_embeddings


def test_bfloat16_params(model_dirs):
    _, params, _ = load_model(model_dirs["qwen3"], "bfloat16")
    assert params["layers"]["wq"].dtype.name == "bfloat16"


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Phi3ForCausalLM"]}, "unsupported architectures"),
    ({"architectures": None}, "unsupported architectures"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
])
def test_bad_config_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**hf_config("llama"), **change})


def test_missing_files_are_clear_errors(model_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nowhere"))
    d = copy_of(model_dirs, "llama", tmp_path)
    os.remove(os.path.join(d, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_model(d)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(d)
    with pytest.raises(ValueError, match="dtype"):
        load_model(d, "float16")


def test_shape_mismatch_and_missing_tensor(model_dirs, tmp_path):
    d = copy_of(model_dirs, "qwen3", tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"{name} has shape"):
        load_model(d)
    del tensors[name]
    save_file(tensors, path)
    with pytest.raises(KeyError, match=name):
        load_model(d)


def test_missing_shard_is_a_clear_error(model_dirs, tmp_path):
    d = copy_of(model_dirs, "qwen2", tmp_path)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[0]
    os.remove(os.path.join(d, shard))
    with pytest.raises(FileNotFoundError, match="missing safetensors shards"):
        load_model(d)


@pytest.mark.parametrize("stored, want", [("bfloat16", "bfloat16"), ("float16", "bfloat16"),
                                          ("float32", "float32"), (None, "float32")])
def test_checkpoint_dtype_is_what_its_weights_fit(tmp_path, stored, want):
    hf = hf_config("llama")
    if stored:
        hf["torch_dtype"] = stored
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert checkpoint_dtype(str(tmp_path)) == want


def test_dtype_auto_is_float32_on_cpu_and_the_params_own_otherwise(model_dirs):
    from runtime.engine import Engine
    from tests.tiny_models import small_config
    assert checkpoint_dtype(None) == "bfloat16"  # the embedded GGUF's Q4_1 blocks
    assert small_config(dtype="auto").resolve_dtype(None, "cpu").dtype == "float32"
    engine = Engine.from_path(model_dirs["llama"], small_config(dtype="auto"))
    engine.close()
    assert engine.engine_cfg.dtype == "float32"
    cfg, params, tokenizer = load_model(model_dirs["llama"], "bfloat16")
    engine = Engine.local(cfg, params, tokenizer, small_config(dtype="auto"))
    engine.close()
    assert engine.engine_cfg.dtype == "bfloat16"
    with pytest.raises(ValueError, match="auto or one of"):
        small_config(dtype="float16")


def test_dtype_auto_on_an_accelerator_is_the_checkpoints(model_dirs, tmp_path):
    from tests.tiny_models import small_config
    assert small_config(dtype="auto").resolve_dtype(None, "gpu").dtype == "bfloat16"  # Q4_1 GGUF
    assert small_config(dtype="auto").resolve_dtype(model_dirs["llama"], "gpu").dtype == "float32"
    hf = {**hf_config("llama"), "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert small_config(dtype="auto").resolve_dtype(str(tmp_path), "gpu").dtype == "bfloat16"
    assert small_config(dtype="float32").resolve_dtype(str(tmp_path), "gpu").dtype == "float32"


def test_a_model_is_served_under_its_checkpoints_name(model_dirs, tmp_path):
    """--served-model-name's default: the directory's name, a GGUF file's without its
    quantization, the embedded model's (as SGLang and vLLM name it)."""
    from model.loader import model_name
    assert model_name(model_dirs["qwen3"]) == "qwen3"
    assert model_name(model_dirs["qwen3"] + "/") == "qwen3"
    assert model_name(None) == "SmolLM2-135M-Instruct"
    gguf = tmp_path / "gemma-2-2b-it.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_name(str(gguf)) == "gemma-2-2b-it"
