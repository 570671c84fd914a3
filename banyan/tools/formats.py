"""How a model family writes tool calls, and which family a chat template belongs to.

    hermes       <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>     Qwen2/2.5/3, Hermes
                 (one block per call; the chat template renders the tool list itself)
    llama3_json  {"name": "f", "parameters": {...}}                               Llama 3.1/3.2/3.3
                 (the whole message is the call; calls separated by "; "; an optional <|python_tag|>)
    json_list    <tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>   templates that ignore
                 `tools`, the default model (SmolLM2) among them: banyan describes the tools in a
                 system message and writes past calls into the history itself (see prompt.py)

A format is data: the literal text around and between calls, the key that holds the arguments, and
what starts a tool section in free text (`trigger`; None: only at the very start of the message).
"""

from __future__ import annotations

from dataclasses import dataclass

from banyan.registry import Registry


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    section_open: str
    """Before the first call of a message's tool section."""
    call_open: str
    """Before each call object."""
    call_close: str
    """After each call object."""
    call_separator: str
    """Between two calls."""
    section_close: str
    """After the last call."""
    arguments_key: str
    """The call object's key for the arguments: {"name": ..., <arguments_key>: {...}}."""
    trigger: str | None
    """Text that opens the tool section anywhere in a reply (a prefix of section_open + call_open);
    None when the section can only be the whole reply."""
    renders_tools: bool
    """The chat template renders the tool list and past calls itself (else banyan does)."""

    @property
    def opening(self) -> str:
        """The literal text before the first call object."""
        return self.section_open + self.call_open


HERMES = ToolCallFormat(
    name="hermes", section_open="", call_open="<tool_call>\n", call_close="\n</tool_call>", call_separator="\n",
    section_close="", arguments_key="arguments", trigger="<tool_call>", renders_tools=True,
)
LLAMA3_JSON = ToolCallFormat(
    name="llama3_json", section_open="", call_open="", call_close="", call_separator="; ", section_close="",
    arguments_key="parameters", trigger=None, renders_tools=True,
)
JSON_LIST = ToolCallFormat(
    name="json_list", section_open="<tool_call>[", call_open="", call_close="", call_separator=", ",
    section_close="]</tool_call>", arguments_key="arguments", trigger="<tool_call>", renders_tools=False,
)
FORMATS: Registry[ToolCallFormat] = Registry("tool_call_parser")
for _format in (HERMES, LLAMA3_JSON, JSON_LIST):
    FORMATS.register(_format.name, _format)
PYTHON_TAG = "<|python_tag|>"
"""Llama 3's marker before a tool call; a special token, optional before the JSON."""


def format_named(name: str) -> ToolCallFormat:
    return FORMATS.get(name)


def detect_format(template: str) -> ToolCallFormat:
    """The format a chat template was written for, read from its source."""
    if "<tool_call>" in template and "tools" in template:
        return HERMES
    if "<|start_header_id|>" in template and "tools" in template:
        return LLAMA3_JSON
    return JSON_LIST
