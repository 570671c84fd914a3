"""StructuredOutputSpec: what one request's output must match, in vLLM's vocabulary, checked up front.

    StructuredOutputSpec.json({"type": "object", ...})      a JSON Schema (dict or JSON text)
    StructuredOutputSpec.json_object()                      any JSON object
    StructuredOutputSpec.regex(r"[0-9]{3}-[0-9]{4}")        the whole output matches the regex
    StructuredOutputSpec.choice(["yes", "no"])              exactly one of the strings
    StructuredOutputSpec.grammar('root ::= "a"+')           Lark, EBNF or GBNF text
    StructuredOutputSpec.from_dict({"json": {...}})         vLLM's `structured_outputs` / guided_* shape

JSON is compact unless asked otherwise: no whitespace between tokens (`{"a":1,"b":[2,3]}`), as
OpenAI writes it, so a sampled answer cannot spend its budget on whitespace. `compact=False` (vLLM's
`disable_any_whitespace: false`) lets up to MAX_WHITESPACE whitespace characters separate tokens;
`None` leaves the choice to the engine (its `structured_outputs_config`, compact by default).

Construction checks what needs no backend: types, sizes, nesting depth and regex repeat counts, so a
hostile spec (1 MiB enum, 10k-deep schema, `a{1,100000}`) is a StructuredOutputError before any
compiler sees it. What a backend cannot express is its own check, at compile time (see backend.py).
The spec is frozen and hashable; `cache_key` names it canonically for the grammar cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from banyan.errors import InvalidParameterError

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")

MAX_SPEC_CHARS = 128 * 1024
"""Longest schema / regex / grammar text, and the longest choice list (all strings together)."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in a JSON Schema document (a data level is about 2-3 of these)."""
MAX_REGEX_REPEAT = 1000
"""Largest counted repetition `{m,n}` in a regex, a schema `pattern` or a grammar."""
MAX_CHOICES = 4096


class StructuredOutputError(InvalidParameterError):
    """A structured-output spec is malformed, unsupported by the backend, or too complex.

    `param` names the request field (the server maps it to `response_format`, `tools`, ...), the
    message names the keyword or the problem."""

    def __init__(self, param: str, message: str):
        super().__init__(param, message)
        self.message = message

    def with_param(self, param: str) -> StructuredOutputError:
        """The same error reported against another request field."""
        return StructuredOutputError(param, self.message)


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: Kind
    text: str = ""
    """json: the schema as compact JSON text (key order kept: it orders the generated properties);
    regex, grammar: the source; choice: a JSON list of the strings; json_object: empty."""
    compact: bool | None = None
    """JSON kinds: True, no whitespace between tokens (vLLM's disable_any_whitespace); False, a run of
    at most MAX_WHITESPACE whitespace characters may separate tokens; None, the engine's default
    (see `with_default_whitespace`; a backend given None compiles it compact)."""

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def json(cls, schema: dict | str, compact: bool | None = None) -> StructuredOutputSpec:
        return cls("json", _canonical_schema(schema), compact)

    @classmethod
    def json_object(cls, compact: bool | None = None) -> StructuredOutputSpec:
        return cls("json_object", "", compact)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        _check_text("regex", pattern)
        check_regex_repeats("regex", pattern)
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputSpec:
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
            raise _error("choice", "must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise _error("choice", f"at most {MAX_CHOICES} choices, got {len(choices)}")
        if not all(isinstance(c, str) for c in choices):
            raise _error("choice", "every choice must be a string")
        text = json.dumps(list(choices), ensure_ascii=False)
        _check_text("choice", text)
        return cls("choice", text)

    @classmethod
    def grammar(cls, grammar: str) -> StructuredOutputSpec:
        _check_text("grammar", grammar)
        if not grammar.strip():
            raise _error("grammar", "must not be empty")
        check_regex_repeats("grammar", grammar)
        return cls("grammar", grammar)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> StructuredOutputSpec:
        """vLLM's StructuredOutputsParams shape: exactly one of json, json_object, regex, choice,
        grammar; `disable_any_whitespace` -> compact (absent: the engine's default). Unknown keys are
        errors, not ignored."""
        if not isinstance(params, dict):
            raise StructuredOutputError("structured_outputs", "must be an object")
        known = set(KINDS) | {"disable_any_whitespace"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise StructuredOutputError("structured_outputs", f"unsupported field(s): {', '.join(unknown)}")
        given = [k for k in KINDS if params.get(k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                "structured_outputs", f"exactly one of {', '.join(KINDS)} must be set, got {given or 'none'}"
            )
        kind, value = given[0], params[given[0]]
        compact = params.get("disable_any_whitespace")
        if compact is not None and not isinstance(compact, bool):
            raise _error("disable_any_whitespace", f"must be true or false, got {compact!r}")
        if kind == "json":
            return cls.json(value, compact)
        if kind == "json_object":
            return cls.json_object(compact)
        return getattr(cls, kind)(value)

    def with_default_whitespace(self, compact: bool) -> StructuredOutputSpec:
        """This spec with `compact` decided where it was left to the engine (JSON kinds only)."""
        if self.compact is not None or self.kind not in ("json", "json_object"):
            return self
        return dataclasses.replace(self, compact=compact)

    # -- views -------------------------------------------------------------------------------------
    @property
    def free_whitespace(self) -> bool:
        """JSON kinds: whitespace may separate tokens (only where `compact` is False)."""
        return self.compact is False

    @property
    def schema(self) -> dict:
        """The JSON Schema (json: as given; json_object: {"type": "object"})."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json":
            raise ValueError(f"a {self.kind} spec has no schema")
        return json.loads(self.text)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text)

    @property
    def param(self) -> str:
        """The request field errors about this spec name."""
        return f"structured_outputs.{self.kind}"

    @property
    def cache_key(self) -> str:
        """Canonical and short: equal specs (same kind, text, options) have equal keys."""
        digest = hashlib.sha256(self.text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{self.kind}:{int(not self.free_whitespace)}:{digest}"

    def error(self, message: str) -> StructuredOutputError:
        return StructuredOutputError(self.param, message)


def default_compact(options: dict[str, Any] | None) -> bool:
    """Whether JSON is compact where a request leaves it to the engine, from the engine's
    structured_outputs_config (vLLM's name; of its options only disable_any_whitespace): compact unless told."""
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise InvalidParameterError("structured_outputs_config", f"must be a JSON object, got {options!r}")
    unknown = sorted(set(options) - {"disable_any_whitespace"})
    if unknown:
        raise InvalidParameterError("structured_outputs_config", f"unsupported option(s) {', '.join(unknown)}; "
                                    "only disable_any_whitespace is")
    compact = options.get("disable_any_whitespace", True)
    if not isinstance(compact, bool):
        raise InvalidParameterError("structured_outputs_config", f"disable_any_whitespace must be true or false, "
                                    f"got {compact!r}")
    return compact


# -- checks -----------------------------------------------------------------------------------------
def _error(kind: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(f"structured_outputs.{kind}", message)


def _check_text(kind: str, text) -> None:
    if not isinstance(text, str):
        raise _error(kind, f"must be a string, got {type(text).__name__}")
    if len(text) > MAX_SPEC_CHARS:
        raise _error(kind, f"is {len(text)} characters long; the limit is {MAX_SPEC_CHARS}")


def _canonical_schema(schema: dict | str) -> str:
    if isinstance(schema, str):
        _check_text("json", schema)
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise _error("json", f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as e:
            raise _error("json", f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise _error("json", f"the schema must be a JSON object, got {type(schema).__name__}")
    _check_depth(schema)
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _error("json", f"the schema is not JSON data: {e}") from None
    _check_text("json", text)
    for pattern in _schema_patterns(schema):
        check_regex_repeats("json", pattern)
    return text


def _check_depth(schema: dict) -> None:
    """Iterative, so a 10k-deep schema is an error here rather than a RecursionError (or a crash) later."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _error("json", f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _schema_patterns(schema: dict) -> list[str]:
    """Every `pattern` string and `patternProperties` key in the schema (depth already bounded)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(node["patternProperties"])
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return found


_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_regex_repeats(kind: str, text: str) -> None:
    """Counted repetitions (regex and GBNF `{m}`, `{m,}`, `{m,n}`; Lark `~ m..n`) above MAX_REGEX_REPEAT make automata (and
    compile times) explode in some backends: refuse them by number rather than by timeout."""
    for match in _REPEAT.finditer(text):
        for bound in match.groups():
            if bound and (len(bound) > 7 or int(bound) > MAX_REGEX_REPEAT):
                raise _error(
                    kind, f"repetition {match.group(0)} exceeds the limit of {MAX_REGEX_REPEAT} repeats"
                )
