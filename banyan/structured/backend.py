"""Grammar backends by name: one small interface over llguidance (default) and xgrammar.

    backend = make_backend("llguidance", tokenizer, vocab_size=model_vocab, eos_token_ids=[2])
    compiled = backend.compile(spec)          # slow-ish, may raise StructuredOutputError: run it
                                              # through GrammarCache, off the engine thread
    matcher = backend.matcher(compiled)       # cheap: one per request
    each step:  matcher.fill_bitmask(bitmask, row)      # row of a [batch, ceil(vocab/32)] int32 mask
                apply_bitmask(logits, bitmask, rows)    # bitmask.py, on the device
                ok = matcher.accept_token(sampled)      # False -> end that request with an error
                matcher.is_terminated()                 # True -> the request is done
    jump-forward: matcher.forced_tokens() are tokens the grammar forces next; append them and
                  accept each without a forward pass per token.

Both backends fill the same bitmask layout: bit (t % 32) of int32 word [row, t // 32] is 1 when
token t is allowed. Ids the tokenizer lacks (model vocab > tokenizer vocab) are never allowed, nor
are special tokens other than EOS; EOS is allowed exactly where the grammar can end.
Backend modules are imported only when chosen, so the library of the other backend is never loaded.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from banyan.registry import Registry
from banyan.structured.spec import StructuredOutputSpec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

DEFAULT_BACKEND = "llguidance"
BACKENDS: Registry[type[GrammarBackend]] = Registry("structured_output_backend")
BACKENDS.register("llguidance", "banyan.structured.llguidance_backend:LLGuidanceBackend")
BACKENDS.register("xgrammar", "banyan.structured.xgrammar_backend:XGrammarBackend")
INSTALL = {"llguidance": "pip install llguidance", "xgrammar": 'pip install --no-deps "xgrammar>=0.2.9"'}
"""How to install each backend's library, for the error when it is missing."""
MAX_WHITESPACE = 16
"""Longest whitespace run between JSON tokens where a spec asks for free whitespace (compact=False):
enough for pretty-printing, and a model cannot loop on whitespace forever."""
MAX_ERROR_CHARS = 500
T = TypeVar("T")


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for one backend and tokenizer; shared read-only by all its matchers."""

    spec: StructuredOutputSpec
    backend: str
    handle: Any = field(repr=False, compare=False)
    size_bytes: int
    """Memory held (the library's figure where it reports one, else an estimate): the cache's budget."""


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: one owner at a time."""

    error: str = ""
    """Why the matcher failed ("" while it has not): a rejected token, or a library limit hit while
    computing a mask. Once set, the engine ends this request (only) with the message."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (CPU, int32, contiguous). No state change."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token (EOS included); False if the grammar forbids it (then `error` says why)."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return all(self.accept_token(t) for t in token_ids)

    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: EOS was accepted, or the grammar allows nothing but EOS."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, jump-forward retokenizing)."""

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids, in order, the grammar accepts from here (none past its end); the state is left
        as it was, `error` too (speculation cuts its drafts there: a refused draft is no fault of the output).
        This default accepts and rolls back, for libraries whose refusal changes nothing."""
        error, count = self.error, 0
        for token_id in token_ids:
            if self.is_terminated() or not self.accept_token(token_id):
                break
            count += 1
        self.error = error
        if count:
            self.rollback(count)
        return count

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (possibly none); accepting them is the caller's move."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar (preemption with recompute replays the output)."""


class GrammarBackend(ABC):
    name: ClassVar[str]

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int] | None = None):
        """vocab_size: the MODEL's vocabulary (lm_head rows), at least the tokenizer's; the bitmask
        has ceil(vocab_size / 32) words per row. eos_token_ids default to the tokenizer's EOS."""
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if not eos_token_ids:
            raise ValueError("the tokenizer has no EOS token: pass eos_token_ids")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Compile and check the spec; StructuredOutputError names what is unsupported or wrong.
        Thread-safe; may take a while for big grammars, so call it through GrammarCache."""
        import torch  # here, not at the top: `import banyan` (SamplingParams -> spec) stays torch-free

        compiled = self._compile(spec)
        probe = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        matcher = self.matcher(compiled)
        matcher.fill_bitmask(probe, 0)
        if matcher.error or not bool(probe.any()):  # e.g. a $ref cycle: no token could ever be sampled
            raise spec.error(f"{self.name}: the grammar matches no output {matcher.error}".rstrip())
        return compiled

    @abstractmethod
    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The library's compile; raises StructuredOutputError."""

    @abstractmethod
    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (microseconds)."""

    def fill_bitmasks(self, bitmask: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]) -> None:
        """Fill the rows of many matchers: [(row, matcher), ...]. Never raises: a matcher whose library
        call fails gets `error` set and a row that allows nothing, and the others are filled all the
        same, so a grammar failure ends its own request only (RELIABILITY C4 G7)."""
        try:
            self._fill_batch(bitmask, matchers)
        except Exception:  # find the culprit one by one
            for row, matcher in matchers:
                try:
                    matcher.fill_bitmask(bitmask, row)
                except Exception as e:
                    _library_failed(matcher, e)
                    bitmask[row].zero_()

    def _fill_batch(self, bitmask: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]) -> None:
        """Backends may fill the rows in parallel."""
        for row, matcher in matchers:
            matcher.fill_bitmask(bitmask, row)


def guarded(matcher: GrammarMatcher, call: Callable[[], T], failed: T) -> T:
    """call(), or `failed` with matcher.error set if the grammar library raised (its request ends)."""
    try:
        return call()
    except Exception as e:
        _library_failed(matcher, e)
        return failed


def _library_failed(matcher: GrammarMatcher, e: Exception) -> None:
    matcher.error = matcher.error or f"the grammar library failed: {library_message(e)}"


def make_backend(
    name: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int] | None = None
) -> GrammarBackend:
    """The backend called `name` (see BACKENDS), importing its library only now; ValueError when it is unknown
    (UnknownChoiceError) or its library is missing."""
    try:
        backend_class = BACKENDS.get(name)
    except ImportError as e:
        raise ValueError(f"the {name} structured-output backend needs its library ({e}): {INSTALL[name]}") from None
    return backend_class(tokenizer, vocab_size, eos_token_ids)


_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:123: "


def library_message(e: BaseException | str) -> str:
    """A library's error as a one-paragraph message: source locations dropped, length bounded."""
    text = _LOG_PREFIX.sub("", str(e)).strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
