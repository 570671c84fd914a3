r"""xgrammar (second backend): pushdown automaton with masks precomputed per grammar at compile time.

Masks are fast (about a microsecond a token for JSON) but each new schema costs tens of
milliseconds to compile, and xgrammar's JSON-Schema converter silently ignores keywords it does not
implement. banyan does not pass those on: `_checked_schema` walks the schema first and refuses any
keyword outside what xgrammar enforces (measured by the support-matrix test), naming it.

Upstream bug mlc-ai/xgrammar#800: a string with minLength/maxLength accepts raw control characters
(invalid JSON). Worked around, not rejected: the converter gives such strings the character class
`[^\"\\\r\n]` (controls other than CR/LF slip through), and every string class also admits UTF-8
encoded surrogates (ED A0 80..ED BF BF, invalid UTF-8 that detokenizes to three U+FFFD, breaking
maxLength). banyan converts the schema to EBNF, swaps both classes for `[^\0-\x1f\"\\\ud800-\udfff]`
(what JSON allows unescaped, as valid UTF-8) and compiles that: same cost, and a no-op once upstream
fixes it. (Rewriting the length into a `pattern` also works but takes seconds to compile for
maxLength 100 with a 49k vocabulary.) Length together with `pattern` or `format` is refused, since
xgrammar then ignores the length. Still open upstream: `.` and negated classes in a `regex` spec or
a schema `pattern` admit encoded surrogates (llguidance does not).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch
import xgrammar as xgr

from banyan.structured.backend import MAX_WHITESPACE, CompiledGrammar, GrammarBackend, GrammarMatcher, library_message
from banyan.structured.spec import StructuredOutputError, StructuredOutputSpec

_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "discriminator",
}  # fmt: skip
_ENFORCED = _ANNOTATIONS | {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
    "pattern", "format", "anyOf", "$ref", "$defs", "definitions", "minItems", "maxItems", "minProperties",
    "maxProperties",
}  # fmt: skip
_FORMATS = {
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer", "uuid",
}  # fmt: skip
_STRING_CLASSES = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')  # length-bounded (#800), plain strings
_STRING_CHARS = r'[^\0-\x1f\"\\\ud800-\udfff]'  # what JSON allows unescaped, valid UTF-8 only


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = _tokenizer_info(tokenizer, vocab_size, self.eos_token_ids)
        # banyan's GrammarCache bounds memory; xgrammar's own cache would be a second, unbounded one
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch: xgr.BatchGrammarMatcher | None = None

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        try:
            compiled = self._grammar(spec)
        except StructuredOutputError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError, ValueError and its own InvalidJSONError
            raise spec.error(f"xgrammar: {library_message(e)}") from None
        return CompiledGrammar(spec, self.name, compiled, compiled.memory_size_bytes)

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.handle))

    def _fill_batch(self, bitmask: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]) -> None:
        if len(matchers) < 2:
            return super()._fill_batch(bitmask, matchers)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        handles = [m._matcher for _, m in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(handles, bitmask, [row for row, _ in matchers])

    def _grammar(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        if spec.kind in ("json", "json_object"):
            whitespace = dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE) if spec.free_whitespace else dict(
                any_whitespace=False, separators=(",", ":")
            )
            # strict mode (no undeclared properties) except for json_object, where it would allow only {}
            schema = json.dumps(_checked_schema(spec)) if spec.kind == "json" else '{"type":"object"}'
            ebnf = str(xgr.Grammar.from_json_schema(schema, strict_mode=spec.kind == "json", **whitespace))
            for wrong in _STRING_CLASSES:  # #800 and encoded surrogates, see the module docstring
                ebnf = ebnf.replace(wrong, _STRING_CHARS)
            return self._compiler.compile_grammar(ebnf)
        if spec.kind == "regex":
            _check_pattern(spec, spec.text)
            return self._compiler.compile_regex(spec.text)
        if spec.kind == "choice":  # EBNF string literals take JSON escapes
            choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices)
            return self._compiler.compile_grammar(f"root ::= {choices}")
        if "::=" in spec.text:  # EBNF / GBNF (root rule `root`), else Lark
            return self._compiler.compile_grammar(spec.text)
        return self._compiler.compile_lark(spec.text)


def _checked_schema(spec: StructuredOutputSpec) -> dict:
    """The schema, or a StructuredOutputError naming what xgrammar would silently ignore."""
    schema = spec.schema
    stack: list = [schema]
    while stack:  # depth is bounded by the spec's own check
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        unsupported = sorted(k for k in node if k not in _ENFORCED and not k.startswith("x-"))
        if unsupported:
            raise spec.error(f"xgrammar does not support the JSON-Schema keyword(s) {', '.join(unsupported)}")
        if "format" in node and node["format"] not in _FORMATS:
            raise spec.error(f"xgrammar does not support format {node['format']!r}")
        if isinstance(node.get("items"), list):
            raise spec.error("xgrammar does not support `items` as a list; use prefixItems")
        if ("minLength" in node or "maxLength" in node) and ("pattern" in node or "format" in node):
            raise spec.error("xgrammar ignores minLength/maxLength together with pattern or format")
        if isinstance(node.get("pattern"), str):
            _check_pattern(spec, node["pattern"])
        for key in ("properties", "$defs", "definitions"):
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in ("prefixItems", "anyOf"):
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack += [node.get("items"), node.get("additionalProperties")]
    return schema


def _check_pattern(spec: StructuredOutputSpec, pattern: str) -> None:
    if _nested_unbounded_repeat(pattern):
        raise spec.error(
            f"xgrammar: pattern {pattern!r} repeats a group that itself repeats without bound, e.g. ((a*)*)*: "
            "its per-token cost grows with the output (RELIABILITY C4 G3); use the llguidance backend"
        )
    try:
        xgr.Grammar.from_regex(pattern)  # raises on lookaround, backreferences, bad syntax
    except Exception as e:
        raise spec.error(f"xgrammar cannot use pattern {pattern!r}: {library_message(e)}") from None


_UNBOUNDED = re.compile(r"[*+]|\{\d+,\}")


def _nested_unbounded_repeat(regex: str) -> bool:
    r"""A group holding an unbounded repeat, itself repeated without bound and not ending in a
    literal separator: (a+)+, ((a*)*)*b, ([a-z]+)*x, (\w+\s?)* -- but not ([a-z]+\.)+ or ([a-z]+-)*.

    xgrammar's Earley parser keeps every way of splitting the text between the two repeats, so each
    token costs more than the last (measured with a 49k vocabulary: ((a*)*)*b 326 ms a token after 44
    tokens, (\w+\s?)*$ 63 ms after 53). A rough scan: escapes and character classes skipped."""
    stack, i = [False], 0  # stack[-1]: the open group holds an unbounded repeat
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # skip the class: a ] right after [ or [^ is a literal
            i += 2 if regex[i + 1 : i + 2] == "^" else 1
            i = regex.find("]", i + 1)
            if i < 0:
                return False
        elif c == "(":
            stack.append(False)
        elif c == ")" and len(stack) > 1:
            inner = stack.pop()
            if inner and _UNBOUNDED.match(regex, i + 1) and not _ends_in_literal(regex, i):
                return True
            stack[-1] |= inner
        elif _UNBOUNDED.match(regex, i):
            stack[-1] = True
        i += 1
    return False


def _ends_in_literal(regex: str, close: int) -> bool:
    r"""The group closing at `close` ends with a literal character (an escaped one counts, \w etc. not)."""
    last = regex[close - 1]
    if close >= 2 and regex[close - 2] == "\\":
        return last not in "dDwWsSbBpP"
    return last not in "*+?})]|(.^$"


def _tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's TokenizerInfo with every special token made empty, which xgrammar never allows.

    from_huggingface alone decodes added special tokens such as <|im_start|> as their literal text,
    so a JSON string could contain them, and they vanish from the detokenized output."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    special = set(tokenizer.all_special_ids)
    special |= {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    for token_id in special:
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=eos_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.accept_token(token_id):
            return True
        self.error = f"token {token_id} is not allowed here"
        return False

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        return self._matcher.find_jump_forward_tokens()

    def reset(self) -> None:
        self._matcher.reset()
        self.error = ""
