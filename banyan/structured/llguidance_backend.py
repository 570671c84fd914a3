"""llguidance (the default): Earley parser over a derivative-based lexer, built from tokenizer.json.

Compiling checks the grammar and builds one template matcher; each request's matcher is a deep
copy of it (microseconds). llguidance reports unsupported JSON-Schema keywords itself ("Unimplemented
keys: [...]") as long as `lenient` stays off, which banyan forces so a schema's own "x-guidance"
options cannot switch it on. Its parser limits (lexer fuel, Earley items per step) bound the work of
one compile and of one mask, so a pathological grammar ends in an error, not a hang.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import llguidance.hf  # not llguidance.torch: it imports torch._dynamo (3 s)
import torch

from banyan.structured.backend import MAX_WHITESPACE, CompiledGrammar, GrammarBackend, GrammarMatcher, library_message
from banyan.structured.spec import StructuredOutputSpec

_TEMPLATE_OVERHEAD_BYTES = 64 * 1024  # llguidance reports no size: grammar text x 8 + this, an estimate


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        try:  # serializes the Rust tokenizer (incl. added tokens) to tokenizer.json text: ~0.6 s for 49k tokens
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        except ValueError as e:
            raise ValueError(f"llguidance needs a fast (tokenizers-backed) tokenizer: {e}") from None
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # errors must not echo the grammar
        self._executor: llguidance.LLExecutor | None = None

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        try:
            grammar = self._grammar(spec)
        except (ValueError, TypeError) as e:
            raise spec.error(f"llguidance: {library_message(e)}") from None
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise spec.error(f"llguidance: {library_message(template.get_error())}")
        return CompiledGrammar(spec, self.name, template, 8 * len(grammar) + _TEMPLATE_OVERHEAD_BYTES)

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.handle.deep_copy())

    def _fill_batch(self, bitmask: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]) -> None:
        if len(matchers) < 2:
            return super()._fill_batch(bitmask, matchers)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        if not bitmask.is_contiguous():
            raise ValueError("the bitmask must be contiguous")
        pairs = [(m._matcher, row) for row, m in matchers]  # type: ignore[attr-defined]
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])

    def _grammar(self, spec: StructuredOutputSpec) -> str:
        if spec.kind in ("json", "json_object"):
            options = {"lenient": False, "coerce_one_of": False}
            if spec.free_whitespace:
                options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"
            else:  # exactly "," and ":" between tokens, nothing else
                options["whitespace_flexible"] = False
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, overrides=options)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":  # Lark string literals take JSON escapes
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        if self._matcher.is_error():  # a parser limit hit mid-generation: the row allows nothing
            self.error = self._matcher.get_error()

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.consume_token(token_id):
            return True
        self.error = self._matcher.get_error() or f"token {token_id} is not allowed here"
        return False

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        if self._matcher.consume_tokens(list(token_ids)):
            return True
        self.error = self._matcher.get_error() or "a token is not allowed here"
        return False

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        return self._matcher.validate_tokens(list(token_ids))  # a refused token here would stop the matcher

    def rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def forced_tokens(self) -> list[int]:
        # Forced bytes take ~2 us; tokenizing them up to ~90 us: skip that where nothing is forced.
        return self._matcher.compute_ff_tokens() if self._matcher.compute_ff_bytes() else []

    def reset(self) -> None:
        self._matcher.reset()
        self.error = ""
