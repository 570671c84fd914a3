"""The tool list and past calls in the prompt, for chat templates that do not render them (json_list).

Templates written for tool use (Qwen's, Llama 3's) get `tools` and the messages as they are. For the
others, the default model's among them, banyan describes the tools in the system message and writes
each past assistant call into that message's text, in the format the reply is constrained to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from banyan.tools.formats import ToolCallFormat
from banyan.tools.grammar import ToolSpec


def describe_tools(fmt: ToolCallFormat, tools: Sequence[ToolSpec]) -> str:
    """System-prompt text listing the tools (as JSON) and how to call them."""
    listing = json.dumps([_tool_json(t) for t in tools], ensure_ascii=False)
    example = fmt.opening + '{"name": "<function name>", "' + fmt.arguments_key + '": {<arguments>}}' + fmt.call_close
    example += fmt.section_close
    return (
        "You may call these functions; each is described in JSON Schema:\n"
        f"<tools>{listing}</tools>\n"
        "To call functions, reply with only the call, in exactly this form (list several calls to call "
        f"several functions):\n{example}\n"
        "Otherwise, answer in plain text."
    )


def write_calls(fmt: ToolCallFormat, calls: Sequence[Mapping[str, Any]]) -> str:
    """Past calls (OpenAI's tool_calls, arguments parsed or as text) in the format's own text."""
    bodies = []
    for call in calls:
        function = call.get("function", {})
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        bodies.append(f'{fmt.call_open}{{"name": {json.dumps(function.get("name", ""))}, '
                      f'"{fmt.arguments_key}": {arguments}}}{fmt.call_close}')
    return fmt.section_open + fmt.call_separator.join(bodies) + fmt.section_close


def with_tools_in_text(fmt: ToolCallFormat, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The messages with the tool description in the system message and past calls as text."""
    out = [_calls_as_text(fmt, dict(m)) for m in messages]
    if tools:
        description = describe_tools(fmt, tools)
        if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + description}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out


def _calls_as_text(fmt: ToolCallFormat, message: dict[str, Any]) -> dict[str, Any]:
    calls = message.pop("tool_calls", None)
    if not calls:
        return message
    text = message.get("content") or ""
    message["content"] = (text + ("\n" if text else "") + write_calls(fmt, calls))
    return message


def _tool_json(tool: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    return out
