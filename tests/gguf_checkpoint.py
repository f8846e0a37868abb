"""A tiny HF checkpoint written again as a GGUF file, as llama.cpp's convert_hf_to_gguf.py writes
a Gemma: tensor names from gguf's own name map, 1 added to every norm, its metadata keys, and a
SentencePiece vocabulary (pieces, scores, token types, no merges).

The vocabulary is made up, Gemma-shaped: control tokens first, pieces of spaces stored with real
spaces, byte tokens, then pieces whose scores do not follow their order in the file.
"""
import json
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
_SPECIALS = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
             ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED),
             ("  ", USER_DEFINED), ("   ", USER_DEFINED), ("<b>", USER_DEFINED)]
_PIECES = ["▁", "t", "h", "e", "a", "n", "r", "c", "o", "s", "i", "d", "l", "w", "Y", "N",
           ":", "A", "B", "é", "he", "▁t", "th", "▁th", "▁the", "in", "an", "▁a", "▁an",
           "er", "re", "the", "at", "▁c", "▁ca", "▁cat", "es", "Ye", "Yes", "No", "▁No",
           "on", "▁on", "ed", "nd", "▁and", "ea", "▁ea", "ter", "▁theater", "he▁",
           "ré", "cé", "li", "wo"]
BOS, EOS, UNK = 2, 1, 3
TEXTS = ["the cat", "  the  theater\nand", "héllo wörld", "<start_of_turn>user\nthe cat",
         "", "日本", "a  b   c", "Yes No", "<b>the</b>", "\n\n the\tcat ", "théâtre"]


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of `size` entries."""
    entries = _SPECIALS + [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    entries += [(p, NORMAL) for p in _PIECES]
    if len(entries) > size:
        raise ValueError(f"the vocabulary needs {len(entries)} tokens, the model has {size}")
    entries += [(f"<unused{i}>", CONTROL) for i in range(size - len(entries))]
    rng = np.random.default_rng(0)
    scores = [0.0 if kind != NORMAL else float(-rng.integers(0, 1000)) for _, kind in entries]
    return [t for t, _ in entries], scores, [kind for _, kind in entries]


_ARCHS = {"gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2,
          "gemma3": gguf.MODEL_ARCH.GEMMA3}


def write_gguf(hf_dir: str, path: str) -> str:
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    family = hf["model_type"].removesuffix("_text")
    arch = _ARCHS[family]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, hf, family)
    _write_vocabulary(writer, hf["vocab_size"])
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    for name, array in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        if name == "lm_head.weight":
            continue  # the converters skip it: Gemma ties its head to the embedding
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)),
                          array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: gguf.GGUFWriter, hf: dict, family: str) -> None:
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if family in ("gemma2", "gemma3"):
        writer.add_sliding_window(hf["sliding_window"])
    writer.add_rope_freq_base(hf["rope_theta"])
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])


def _write_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    tokens, scores, types = vocabulary(size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
