"""Tool calling: formats, grammars that make calls well-formed, parsers that read them back."""

from banyan.tools.formats import FORMATS, HERMES, JSON_LIST, LLAMA3_JSON, ToolCallFormat, detect_format, format_named
from banyan.tools.calling import ToolCalling, marker_token_ids
from banyan.tools.grammar import ToolSpec, tool_call_grammar
from banyan.tools.parser import ToolCall, ToolCallDelta, ToolCallParser

__all__ = [
    "FORMATS", "HERMES", "JSON_LIST", "LLAMA3_JSON", "ToolCallFormat", "ToolSpec", "detect_format", "format_named",
    "tool_call_grammar", "ToolCalling", "marker_token_ids", "ToolCall", "ToolCallDelta", "ToolCallParser",
]
