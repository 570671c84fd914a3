"""Tokenizers: loading one, and turning a chat into token ids with control tokens kept safe.

Everything here works for any transformers `PreTrainedTokenizerBase` (fast, slow, or the ones built
from GGUF metadata) and needs no model and no GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from banyan.errors import InvalidParameterError, ModelLoadError
from banyan.text.chat_template import render_chat_template


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The tokenizer (a `PreTrainedTokenizerBase`) AutoTokenizer loads from a Hugging Face directory, loaded
    without torch where the class AutoTokenizer picks follows from the files (see _tokenizer_class)."""
    import transformers

    path = Path(path)
    name = _tokenizer_class(path)
    try:
        if name is not None:
            return getattr(transformers, name).from_pretrained(str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; the user needs one
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


# tokenizer_config.json's tokenizer_class ("Fast" taken off) -> the class AutoTokenizer (transformers 5) loads
_HUB_TOKENIZER_CLASSES = {
    "GPT2Tokenizer": "GPT2Tokenizer",
    "Qwen2Tokenizer": "Qwen2Tokenizer",
    "PreTrainedTokenizer": "TokenizersBackend",
    "TokenizersBackend": "TokenizersBackend",
}


def _tokenizer_class(path: Path) -> str | None:
    """The transformers class AutoTokenizer would load from `path`, where that follows from the files
    alone; None otherwise (then AutoTokenizer itself loads it, which imports torch: its model-type
    tables sit beside the model configs). Known: a tokenizer.json, no remote code, and config.json's
    model_type one of banyan's, or no config.json (a --tokenizer directory). Qwen2's class is fixed by
    the model type; otherwise the hub's class stands (tests/unit/test_import_light.py checks this
    against AutoTokenizer)."""
    config = _json_object(path / "tokenizer_config.json")
    model_config = _json_object(path / "config.json") if (path / "config.json").exists() else {}
    if config is None or model_config is None or "auto_map" in config or not (path / "tokenizer.json").is_file():
        return None  # unreadable files: AutoTokenizer says what is wrong
    model_type = model_config.get("model_type", "")
    if model_type == "qwen2":
        return "Qwen2Tokenizer"
    hub = config.get("tokenizer_class")
    if model_type not in ("", "llama", "qwen3") or not isinstance(hub, str):
        return None
    return _HUB_TOKENIZER_CLASSES.get(hub.removesuffix("Fast"))


def _json_object(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- chat to token ids, with control tokens in user text kept as text (RELIABILITY M5) ------------
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"  # private-use code points around user control tokens


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], **render_kwargs: Any) -> tuple[str, list[int]]:
    """Render (as `render_chat_template`) and tokenize a chat. Control tokens the template writes (like
    `<|im_start|>`) become control token ids; the same text inside messages, tools, documents or template
    kwargs is tokenized as plain text, so a user cannot inject a role. Returns (prompt text, token ids);
    for a chat without such text the ids equal `tokenizer.encode(text, add_special_tokens=False)`."""
    controls = _control_tokens(tokenizer)
    control_re = re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True))) or "(?!)")
    mark = lambda value: _mark(value, control_re)  # noqa: E731
    for key in ("tools", "documents", "chat_template_kwargs"):
        if render_kwargs.get(key) is not None:
            render_kwargs[key] = mark(render_kwargs[key])
    marked = render_chat_template(tokenizer, mark(list(messages)), **render_kwargs)
    # [text, marked control, text, marked control, ..., text]; None where a lone marker was left behind
    pieces = re.split(f"{_MARK_START}({control_re.pattern}){_MARK_END}|[{_MARK_START}{_MARK_END}]", marked)
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:
            ids += _encode_piece(tokenizer, piece, as_text=i % 2 == 1)
    return "".join(p for p in pieces if p), ids


def _control_tokens(tokenizer) -> set[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {t.content for t in added.values() if getattr(t, "special", False)} | set(tokenizer.all_special_tokens)


def _mark(value: Any, control_re: re.Pattern) -> Any:
    if isinstance(value, str):  # drop markers already there, so a user cannot forge a marked token
        value = value.replace(_MARK_START, "").replace(_MARK_END, "")
        return control_re.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, value)
    if isinstance(value, Mapping):
        return {k: _mark(v, control_re) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(v, control_re) for v in value]
    return value


def _encode_piece(tokenizer, piece: str, as_text: bool) -> list[int]:
    """Encode a piece from the middle of a chat; `as_text` ignores special tokens in it. Encoded after a
    newline (then removed) so SentencePiece does not add the space it puts at the start of a text."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=as_text)

    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids = encode("\n" + piece)
    ids = ids[len(newline):] if ids[: len(newline)] == newline else encode(piece)
    if as_text and tokenizer.convert_tokens_to_ids(piece) in ids:
        raise InvalidParameterError("messages", f"cannot encode {piece!r} as plain text with this tokenizer")
    return ids


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """`ids` between the special tokens (BOS, ...) the tokenizer adds around a text, found by encoding
    a probe with and without them; `ids` themselves stay as they are (a rendered chat's, say)."""
    probe, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    start = next((i for i in range(len(full) - len(probe) + 1) if full[i:i + len(probe)] == probe), None)
    if start is None:  # a tokenizer that rewrites the text itself: add nothing rather than guess
        return ids
    return full[:start] + ids + full[start + len(probe):]


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(i for i, t in added.items() if getattr(t, "special", False)) | set(tokenizer.all_special_ids)




def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, computed by the Rust backend alone where that is the same
    thing: `encode_batch_fast` tracks no offsets, which makes a long text's tokenization about 10x faster and its
    result about 4x cheaper to free. Freeing a tokenizers Encoding holds the GIL (measured on a 2-vCPU EPYC: 0.2 s
    for a 1M-token one with offsets, 0.06 s without), so with the server's text pool busy on huge prompts the
    event loop (/health included) would stall for that long."""
    backend = _plain_backend(tokenizer)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _plain_backend(tokenizer):
    """The tokenizers.Tokenizer behind a transformers tokenizer whose encode is that backend's encode with nothing
    added (a TokenizersBackend that overrides no encoding step, no truncation or padding set, special tokens
    split as the wrapper would split them); None otherwise."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or not hasattr(backend, "encode_batch_fast")
            or type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus
            or type(tokenizer).encode is not TokenizersBackend.encode):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend
