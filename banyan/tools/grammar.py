"""The grammar of a reply with tool calls (llguidance's Lark), so a call cannot be malformed.

    required / named:  the reply is the tool section: opening, calls, closing.
    auto:              free text, or free text up to the trigger (e.g. "<tool_call>") and then the
                       tool section. The text before the trigger is a lazy lexeme: it ends at the
                       first trigger, so once the model writes the trigger the rest is constrained.
                       Formats without a trigger (llama3_json): the reply is either text that does
                       not start with "{" or the tool section.

Each call is `{"name": "<one of the tools>", "<arguments_key>": <arguments>}` in that key order (a
stream can then send the name before the arguments); the arguments follow the tool's JSON-schema
`parameters` through llguidance's %json. Literal markers that are single tokens of the vocabulary
(Qwen's <tool_call>) are written as that token, the way the model emits them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from banyan.tools.formats import PYTHON_TAG, ToolCallFormat


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict
    """The JSON Schema of the arguments (an object schema)."""
    description: str | None = None


def tool_call_grammar(
    fmt: ToolCallFormat,
    tools: Sequence[ToolSpec],
    *,
    auto: bool,
    parallel: bool,
    token_ids: Mapping[str, int],
) -> str:
    """Lark text for a reply calling `tools` (one of them, or several when `parallel`).

    token_ids: marker strings that are single tokens of the vocabulary -> their ids."""
    lit = _Literals(token_ids)
    more = f" ({lit(fmt.call_separator)} call)*" if parallel else ""
    rules = [
        "%llguidance {}",
        f"calls: body {lit(fmt.call_close)}{more} {lit(fmt.section_close)}",
        f"call: {lit(fmt.call_open)} body {lit(fmt.call_close)}",
        "body: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        rules.append(_call_rule(i, tool, fmt.arguments_key))
    rules.extend(_start_rules(fmt, lit, auto))
    return "\n".join(rules) + "\n"


def _start_rules(fmt: ToolCallFormat, lit: _Literals, auto: bool) -> list[str]:
    if fmt.trigger is None:  # llama3_json: the whole reply is the section
        tag = f"{lit(PYTHON_TAG)}?" if PYTHON_TAG in lit.token_ids else ""
        section = f"{tag} {lit(fmt.opening)} calls"
        if not auto:
            return [f"start: {section}"]
        return [f"start: TEXT | {section}", r"TEXT: /([^{\s](.|\n)*)?/"]
    rest = lit(fmt.opening[len(fmt.trigger):])
    if not auto:
        return [f"start: {lit(fmt.opening)} calls"]
    rules = [f"start: TEXT | lead {rest} calls", r"TEXT: /(.|\n)*/"]
    if fmt.trigger in lit.token_ids:  # the marker token, or the marker spelled out in pieces
        rules += [f"lead: TEXT {lit(fmt.trigger)} | lead_text", f"lead_text[lazy]: TEXT {json.dumps(fmt.trigger)}"]
    else:
        rules += [f"lead[lazy]: TEXT {json.dumps(fmt.trigger)}"]
    return rules


def _call_rule(i: int, tool: ToolSpec, arguments_key: str) -> str:
    schema = {k: v for k, v in tool.parameters.items() if k != "x-guidance"}  # options are banyan's, not the caller's
    # At most one space between JSON tokens: arguments are read by programs, and a small model given
    # room for pretty-printing wanders in it (SmolLM2-135M indented and looped until max_tokens).
    schema["x-guidance"] = {"lenient": False, "coerce_one_of": False, "whitespace_pattern": "[ ]?"}
    args = "%json " + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    return (f'tool_{i}: "{{" {_json_string("name")} ":" " "? {_json_string(tool.name)} "," " "? '
            f'{_json_string(arguments_key)} ":" " "? {args} "}}"')


def _json_string(text: str) -> str:
    """A Lark literal matching `text` written as a JSON string (quotes included)."""
    return json.dumps(json.dumps(text))


class _Literals:
    """Lark terms for literal text: quoted strings, with single-token markers as token references."""

    def __init__(self, token_ids: Mapping[str, int]):
        self.token_ids = dict(token_ids)

    def __call__(self, text: str) -> str:
        if not text:
            return ""
        terms, rest = [], text
        while rest:
            marker = next((m for m in self.token_ids if rest.startswith(m)), None)
            if marker is not None:
                terms.append(f"<[{self.token_ids[marker]}]>")
                rest = rest[len(marker):]
                continue
            cut = min((rest.find(m) for m in self.token_ids if rest.find(m) > 0), default=len(rest))
            terms.append(json.dumps(rest[:cut]))
            rest = rest[cut:]
        return " ".join(terms)
