"""Text out of the engine: incremental detokenizing and stop strings, O(window) per token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial

from banyan.text.tokenizer import special_token_ids


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, O(window) per token.

    Tokens are taken one at a time. Each decodes two short windows of ids and emits the difference:

        self._ids:  | prefix window (already emitted) | new tokens (held) |
                    0                             read_offset            end
        prefix = decode(ids[:read_offset]);  text = decode(ids);  delta = text[len(prefix):]
        after emitting, the new tokens become the prefix window (the old one is dropped).

    The first prefix window is the prompt's last few tokens, so a SentencePiece "▁word" right after
    the prompt keeps its space (the continuation of the prompt, as vLLM). While `text` ends in U+FFFD a
    multi-byte character is incomplete and nothing is emitted (for at most MAX_HOLD tokens, so a model
    emitting invalid bytes cannot grow the window without bound). Skipped special tokens never enter
    the windows. Concatenated deltas equal decode(prompt tail + output)[len(decode(prompt tail)):]:
    decode(output) for byte-level BPE, and for SentencePiece too except for that first space.
    Decoding uses clean_up_tokenization_spaces=False.
    """

    PROMPT_WINDOW = 5
    MAX_HOLD = 16

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._skip = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._decode = _plain_decode(tokenizer, skip_special_tokens) or self._decode
        self._token_texts = token_texts(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        tail = [t for t in prompt_token_ids[-4 * self.PROMPT_WINDOW:] if t not in self._skip]
        self._ids: list[int] = tail[-self.PROMPT_WINDOW:]
        self._read_offset = len(self._ids)  # the prefix window is self._ids[:read_offset]

    def add(self, new_token_ids: Sequence[int]) -> str:
        """The new text the tokens add (possibly empty while a character is incomplete)."""
        if len(new_token_ids) == 1:  # a decode step's one token
            token_id = new_token_ids[0]
            return "" if token_id in self._skip else self._step(token_id)
        return "".join(self._step(t) for t in new_token_ids if t not in self._skip)

    def flush(self) -> str:
        """At the end of the output: whatever is still held back (an incomplete character as U+FFFD)."""
        return self._emit() if len(self._ids) > self._read_offset else ""

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if len(self._ids) - self._read_offset >= self.MAX_HOLD:
            return self._emit()
        return self._emit(unless_incomplete=True)

    def _emit(self, unless_incomplete: bool = False) -> str:
        if self._read_offset == 1:  # the prefix window is the last step's one token: its text is known
            prefix = self._token_text(self._ids[0])
        else:
            prefix = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        if unless_incomplete and text.endswith("\ufffd"):
            return ""
        del self._ids[: self._read_offset]  # the new tokens become the next prefix window
        self._read_offset = len(self._ids)
        return text[len(prefix):]

    def _token_text(self, token_id: int) -> str:
        """decode([token_id]), from the texts of the tokens met so far (a dict read instead of a call)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode([token_id])
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


@lru_cache(maxsize=16)
def token_texts(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> dict[int, str]:
    """The text of single tokens as the detokenizers of this tokenizer and options decode them (decode([t]) is a
    function of t alone), filled as they meet them: at most a vocabulary of short strings. Shared, because each
    decode step's prefix window is one token, and a call into the tokenizer costs more than the dict read."""
    return {}


def _plain_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own decode when `tokenizer.decode(ids, clean_up_tokenization_spaces=False)`
    is exactly that call (a fast tokenizer that overrides nothing); None otherwise. transformers'
    wrapper costs three times the decode itself, and the detokenizer decodes twice per token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    base = _fast_tokenizer_class()
    if backend is None or base is None or not isinstance(tokenizer, base):
        return None
    cls = type(tokenizer)
    if cls.decode is not base.decode or cls._decode is not base._decode:
        return None
    return partial(backend.decode, skip_special_tokens=skip_special_tokens)


@lru_cache(maxsize=None)
def _fast_tokenizer_class() -> type | None:
    try:  # transformers >= 5
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as fast
    except ImportError:
        try:
            from transformers import PreTrainedTokenizerFast as fast
        except ImportError:
            return None
    return fast


# -- stop strings ---------------------------------------------------------------------------------
class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    `feed(delta)` returns the text that is safe to emit and, on a match, the stop string; the text after
    a match is dropped and later feeds return nothing. The match is the stop string completed first in
    the stream, so the result does not depend on how the text was cut into deltas. Trailing characters
    that could begin a stop string (at most max(len(stop)) - 1) are held back until they cannot;
    `flush()` returns them at the end.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_on: str | None = None
        self._held = ""
        # for each stop string, the prefix lengths k by their last character: s[k - 1] -> [k, ...] descending
        self._prefix_ends: list[tuple[str, dict[str, list[int]]]] = []
        for s in self.stop:
            ends: dict[str, list[int]] = {}
            for k in range(len(s) - 1, 0, -1):
                ends.setdefault(s[k - 1], []).append(k)
            self._prefix_ends.append((s, ends))

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.stopped_on is not None:
            return "", None
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            at, s = match
            self.stopped_on, self._held = s, ""
            return text[: at + len(s)] if self.include_stop_str_in_output else text[:at], s
        hold = self._partial_match_len(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The stop string completed first (then the one starting first): what a token-by-token stream
        would have found, however the text was cut into deltas."""
        best = None
        for s in self.stop:
            at = text.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < (best[0] + len(best[1]), best[0])):
                best = (at, s)
        return best

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text:
            return 0
        longest = 0
        for s, ends in self._prefix_ends:
            for k in ends.get(text[-1], ()):
                if k <= longest:
                    break
                if k <= len(text) and text.endswith(s[:k]):
                    longest = k
                    break
        return longest
