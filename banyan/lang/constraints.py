"""How each kind of OpenAI-compatible server takes a constrained gen or select: the request fields, by dialect.

    structured_outputs   vLLM and banyan: `structured_outputs: {"regex" | "json" | "choice": ...}`
    llamacpp             llama-server: a JSON schema as `json_schema` (completions) or OpenAI's `response_format`
                         (chat); a choice as a GBNF `grammar` of the options; no regex (it has none)
    openai               anything else, OpenAI itself included: OpenAI's `response_format` with a JSON schema;
                         a choice as a schema whose one property is an enum of the options (OpenAI's strict
                         schemas need an object), read back from the JSON; no regex

The dialect comes from the server's `/v1/models` (`owned_by`), so a program ports between servers unchanged; what a
server cannot take is a typed error naming the call, never a silently unconstrained answer.
"""

from __future__ import annotations

import json

from banyan.lang.errors import BackendError

DIALECTS = {"vllm": "structured_outputs", "banyan": "structured_outputs", "llamacpp": "llamacpp"}
"""/v1/models' owned_by -> dialect; any other server speaks "openai"."""
CHOICE_KEY = "choice"
"""The property an "openai" choice is read from."""


def dialect_of(owned_by: str) -> str:
    return DIALECTS.get(owned_by, "openai")


def gen_fields(dialect: str, call: str, structured: dict | None, chat: bool) -> dict:
    """The request fields constraining a gen as vLLM's `structured` says ({"regex": ...} or {"json": schema};
    None: no constraint)."""
    if structured is None:
        return {}
    if dialect == "structured_outputs":
        return {"structured_outputs": structured}
    schema = structured.get("json")
    if schema is None:
        raise BackendError(call, f"this server ({_name(dialect)}) takes no regex constraint; it takes JSON schemas")
    if dialect == "llamacpp" and not chat:
        return {"json_schema": schema}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}


def choice_fields(dialect: str, choices: list[str]) -> dict:
    """The request fields making the answer one of `choices` (read it back with `chosen`)."""
    if dialect == "structured_outputs":
        return {"structured_outputs": {"choice": list(choices)}}
    if dialect == "llamacpp":
        return {"grammar": "root ::= " + " | ".join(gbnf_literal(c) for c in choices)}
    schema = {"type": "object", "properties": {CHOICE_KEY: {"type": "string", "enum": list(choices)}},
              "required": [CHOICE_KEY], "additionalProperties": False}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "choice", "schema": schema, "strict": True}}}


def chosen(dialect: str, text: str) -> str:
    """The option an answer to `choice_fields` names (the text itself, or the "openai" object's property)."""
    if dialect != "openai":
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value.get(CHOICE_KEY, text) if isinstance(value, dict) else text


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal: quotes, backslashes, brackets and control characters escaped."""
    escaped = []
    for ch in text:
        if ch in '"\\[]':
            escaped.append("\\" + ch)
        elif ch in "\n\r\t":
            escaped.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif ord(ch) < 0x20:
            escaped.append(f"\\x{ord(ch):02x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def _name(dialect: str) -> str:
    return {"llamacpp": "llama-server", "openai": "an OpenAI-compatible server"}.get(dialect, dialect)
