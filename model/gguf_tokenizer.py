"""The tokenizer a GGUF file describes, rebuilt from its metadata (it carries no tokenizer.json).

Two kinds, by `tokenizer.ggml.model`: "gpt2", a byte-level BPE with its merges stored; and
"llama", SentencePiece BPE (Gemma's; not yet Llama 2's or Mistral's, which add a space prefix),
stored as pieces, scores and token types without merges. The merges are recovered from the
pieces: every split of a piece into two others is a merge, ranked by the piece's place in the
file. SentencePiece merges the pair whose result is the best piece first; Gemma's scores do not
follow that order, its file order does (as transformers reads a Gemma GGUF; tested against it).
"""
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from model.gguf_file import GGUFFile
from model.tokenizer import TextTokenizer

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type
_SPACE = "\u2581"  # SentencePiece's "▁"


def gguf_tokenizer(gguf_file: GGUFFile) -> TextTokenizer:
    kind = gguf_file.fields.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported "
                         f"(tokenizer.ggml.model: {sorted(builders)})")
    tokens = gguf_file.fields.get("tokenizer.ggml.tokens")
    types = gguf_file.fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = builders[kind](gguf_file, tokens, types)
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    bos = gguf_file.fields.get("tokenizer.ggml.bos_token_id")
    # llama.cpp puts BOS before a SentencePiece prompt unless the file says not to.
    add_bos = bool(gguf_file.fields.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    return TextTokenizer(tok, start_ids=[int(bos)] if add_bos and bos is not None else [])


def _byte_level_bpe(gguf_file: GGUFFile, tokens: list[str], types) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in gguf_file.fields.get("tokenizer.ggml.merges")]
    tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                          merges=merges, ignore_merges=False))
    # llama.cpp's "smollm" pre-tokenizer: digits split one by one, then GPT-2's byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(gguf_file: GGUFFile, tokens: list[str], types) -> tokenizers.Tokenizer:
    if gguf_file.fields.get("tokenizer.ggml.add_space_prefix", True):
        # Llama 2's and Mistral's: where the "▁" goes (text start, after a special token, per
        # piece of a prompt) differs between SentencePiece, llama.cpp and transformers.
        raise ValueError("GGUF SentencePiece tokenizers with add_space_prefix (Llama 2, "
                         "Mistral) are not supported; Gemma's (add_space_prefix false) are")
    pieces = [_respelled(t) for t in tokens]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    unknown = gguf_file.fields.get("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, kind in enumerate(types) if kind == _UNKNOWN), None)
    tok = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=recovered_merges(pieces), byte_fallback=True, fuse_unk=True,
        unk_token=None if unknown is None else pieces[int(unknown)]))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False)
                    for t, piece, kind in zip(tokens, pieces, types)
                    if kind == _USER_DEFINED and t == piece])
    return tok


def _respelled(token: str) -> str:
    """llama.cpp's converter writes Gemma's pieces of two or more spaces with real spaces;
    spaces reach the model as "▁" (the normalizer), so the piece must be spelled so too."""
    return _SPACE * len(token) if len(token) > 1 and not token.strip(" ") else token


def recovered_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the earlier piece's first; splits of one piece
    with the longer left part first."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    ranked = []
    for i, piece in enumerate(pieces):
        if ids[piece] != i:  # a piece the file lists twice: its last place counts
            continue
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((i, -cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]
