"""A GGUF's tokenizer as a transformers fast tokenizer, built from its metadata.

    tokenizer_from_gguf(meta, path) -> PreTrainedTokenizerFast

llama.cpp stores the vocabulary, merges (or SentencePiece scores), token types and the name of the
pre-tokenizer; this rebuilds the same tokenizer that transformers' own GGUF loading produces:
"gpt2" vocabularies as byte-level BPE with llama.cpp's split regex, "llama" ones as byte-fallback BPE.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from banyan.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex llama.cpp uses before byte-level BPE (default: GPT-2's)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# these split every digit off first, then GPT-2's regex (as SmolLM's own tokenizer.json does)
_PRE_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def tokenizer_from_gguf(meta: dict[str, Any], path: Path) -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer built from the GGUF's vocabulary, merges and token types."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, types)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens)
    else:
        raise UnsupportedModelError(f"{path}: GGUF tokenizer {kind!r} is not supported (gpt2 and llama are)")
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(name: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty not in (_CONTROL, _USER_DEFINED) and not set(t) <= alphabet:  # raw text: spell its bytes
            t = "".join(spelling[b] for b in t.encode("utf-8"))
        vocab[t] = i
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp (like Llama 3's tokenizer.json) takes a whole pre-token that is in the vocabulary as is
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=_PRE_SPLITS.get(pre) is _LLAMA3_SPLIT))
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    elif pre in _PRE_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])  # fmt: skip
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 as itself, the rest from U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in spelling)})
    return spelling


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]):
    """llama.cpp's "llama" (SentencePiece) vocabulary as a byte-fallback BPE, like transformers'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(vocab, tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best
    score first (ties: longer left piece, longer right piece, then vocabulary order), as transformers does."""
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
