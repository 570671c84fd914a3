"""ToolCalling: tool calling for one chat request, from OpenAI's `tools` and `tool_choice`.

    calling = ToolCalling.from_request(fmt, tools, tool_choice, parallel_tool_calls)
    messages, template_tools = calling.template_inputs(messages)   # what the chat template renders
    spec = calling.spec(marker_token_ids(tokenizer, fmt))           # None for tool_choice "none"
    parser = calling.parser()                                       # reads the reply's calls back

tool_choice "none" leaves the tools out of the prompt and the reply unconstrained; "auto" lets the
model answer in text or call tools (constrained from the trigger on); "required" and a named
function constrain the whole reply to calls (a named function: exactly one call of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from banyan.errors import InvalidParameterError
from banyan.structured.spec import StructuredOutputError, StructuredOutputSpec
from banyan.tools.formats import PYTHON_TAG, ToolCallFormat
from banyan.tools.grammar import ToolSpec, tool_call_grammar
from banyan.tools.parser import ToolCallParser
from banyan.tools.prompt import with_tools_in_text

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCalling:
    fmt: ToolCallFormat
    tools: tuple[ToolSpec, ...]
    mode: str
    """none, auto, required, or named (then `tools` holds only the named function)."""
    parallel: bool = True
    offered: tuple[ToolSpec, ...] = ()
    """Every tool of the request (the prompt lists them all, even when one is named)."""

    @classmethod
    def from_request(cls, fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                     parallel_tool_calls: bool | None) -> ToolCalling:
        """tools: OpenAI's [{"type": "function", "function": {name, description, parameters}}]."""
        specs = _tool_specs(tools or [])
        choice = tool_choice if tool_choice is not None else ("auto" if specs else "none")
        parallel = parallel_tool_calls is not False
        if isinstance(choice, Mapping):
            name = choice["function"]["name"]
            named = [t for t in specs if t.name == name]
            if not named:
                raise InvalidParameterError("tool_choice", f"names the function {name!r}, which is not in `tools`")
            return cls(fmt, tuple(named), "named", False, tuple(specs))
        if choice in ("auto", "required") and not specs:
            raise InvalidParameterError("tool_choice", f"{choice!r} needs at least one tool in `tools`")
        return cls(fmt, tuple(specs), choice, parallel, tuple(specs))

    @property
    def active(self) -> bool:
        """The reply may hold calls (the output is parsed for them)."""
        return self.mode != "none"

    def template_inputs(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for the chat template."""
        offered = self.offered if self.active else ()
        if not self.fmt.renders_tools:
            return with_tools_in_text(self.fmt, messages, offered), None
        return [dict(m) for m in messages], [_openai_tool(t) for t in offered] or None

    def spec(self, token_ids: Mapping[str, int]) -> StructuredOutputSpec | None:
        """The grammar of the reply (llguidance Lark), or None when the reply is free."""
        if not self.active:
            return None
        grammar = tool_call_grammar(self.fmt, self.tools, auto=self.mode == "auto", parallel=self.parallel,
                                    token_ids=token_ids)
        try:
            return StructuredOutputSpec.grammar(grammar)
        except StructuredOutputError as e:
            raise e.with_param("tools") from None

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.fmt) if self.active else None


def marker_token_ids(tokenizer, fmt: ToolCallFormat) -> dict[str, int]:
    """The format's markers that are single added tokens of the vocabulary (e.g. Qwen's <tool_call>)."""
    added = tokenizer.get_added_vocab()
    markers = {fmt.trigger or "", "</tool_call>", PYTHON_TAG, fmt.opening.strip(), fmt.call_close.strip()}
    return {m: added[m] for m in markers if m and m in added}


def _tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    if len(tools) > MAX_TOOLS:
        raise InvalidParameterError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    specs, seen = [], set()
    for i, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        if name in seen:
            raise InvalidParameterError(f"tools[{i}].function.name", f"{name!r} is defined twice")
        seen.add(name)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        _check_parameters(f"tools[{i}].function.parameters", parameters)
        specs.append(ToolSpec(name, parameters, function.get("description")))
    return specs


def _check_parameters(param: str, parameters: dict) -> None:
    """The arguments' schema: an object schema that passes the structured-output checks (size, depth, regex)."""
    if parameters.get("type", "object") != "object":
        raise InvalidParameterError(param, f"must describe a JSON object (type \"object\"), got type {parameters['type']!r}")
    try:
        StructuredOutputSpec.json(parameters)
    except StructuredOutputError as e:
        raise e.with_param(param) from None


def _openai_tool(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}
