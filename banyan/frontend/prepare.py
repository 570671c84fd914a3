"""Request preparation: what a user asks for -> engine requests. One path for the offline `LLM` and the server.

    messages + ChatInput ──► tool_calling() ──► ToolCalling     how tools reach the prompt, the reply's parser
                         ──► render_chat()  ──► prompt ids      chat template (sandboxed), user control tokens kept text
                         ──► tool_grammar() ──► the reply's structured output when it may hold calls
                             (prepare_chat: the three in turn, for conversations sharing one ChatInput)
    SamplingParams + key ──► fan_out()      ──► SequenceRequest x num_sequences

Fan-out of one prompt (n choices, or best_of candidates of which the n best are returned):

    engine request id = f"{key}-{j}"    j = 0 .. num_sequences - 1; the server's key is f"{http key}-{p}"
    params            = params.sequence_params(j): seed + j, n = 1, logprobs for ranking best_of

Plain synchronous functions that raise banyan's typed errors (InvalidParameterError, ChatTemplateError):
the server runs the slow ones (rendering) in its worker pool under its render time cap, and turns the
errors into HTTP answers; the offline API lets them propagate.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from banyan.errors import InvalidParameterError
from banyan.sampling_params import SamplingParams
from banyan.structured.spec import StructuredOutputSpec
from banyan.text.chat_template import DEFAULT_RENDER_TIMEOUT, resolve_template
from banyan.text.tokenizer import encode_chat
from banyan.tools import ToolCalling, detect_format, format_named, marker_token_ids

TOOLS_BACKEND = "llguidance"
"""The structured-output backend tool-call grammars are written for (Lark with token markers)."""


@dataclass(frozen=True)
class ChatInput:
    """How a chat request asks to be rendered, and which tools its reply may call (OpenAI's shapes)."""

    chat_template: str | None = None
    """A template, or the name of one of the tokenizer's; None: the tokenizer's own."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    """[{"type": "function", "function": {"name", "description", "parameters"}}]"""
    tool_choice: str | Mapping[str, Any] | None = None
    """"none", "auto" (the default with tools), "required", or {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class SequenceRequest:
    """One engine request: sequence `index` of a prompt's num_sequences."""

    request_id: str
    index: int
    params: SamplingParams


def tool_calling(tokenizer, chat: ChatInput, *, backend: str, parser: str = "auto",
                 structured_param: str | None = None) -> ToolCalling:
    """How the chat's tools reach its prompt and its reply. `parser` "auto" reads the format from the
    template the chat renders with; `backend`: the engine's structured-output backend, which must be
    llguidance when the reply may hold calls; `structured_param`: the request field that already asks
    for a structured output, if any (refused alongside calls). Raises InvalidParameterError for a bad
    tool, tool_choice or combination, ChatTemplateError when there is no template to read."""
    if parser == "auto":
        fmt = detect_format(resolve_template(tokenizer, chat.chat_template, chat.tools))
    else:
        fmt = format_named(parser)
    calling = ToolCalling.from_request(fmt, chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    if calling.active and structured_param:
        raise InvalidParameterError(structured_param, "cannot be combined with tools unless tool_choice is 'none'")
    if calling.active and backend != TOOLS_BACKEND:
        raise InvalidParameterError("tools", f"tool calling needs the {TOOLS_BACKEND} structured-output backend "
                                             f"(this engine runs {backend})")
    return calling


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], chat: ChatInput, calling: ToolCalling, *,
                timeout: float | None = DEFAULT_RENDER_TIMEOUT,
                cancel: threading.Event | None = None) -> tuple[str, list[int]]:
    """(prompt text, prompt ids) of a conversation, the tools in it as `calling` puts them. The template
    writes any BOS itself; control tokens typed inside messages stay plain text. `timeout` and `cancel`
    stop a render that runs too long (ChatTemplateError)."""
    messages, tools = calling.template_inputs(messages)
    return encode_chat(tokenizer, messages, chat_template=chat.chat_template, tools=tools, documents=chat.documents,
                       add_generation_prompt=chat.add_generation_prompt, continue_final_message=chat.continue_final_message,
                       chat_template_kwargs=chat.chat_template_kwargs, timeout=timeout, cancel=cancel)


def tool_grammar(calling: ToolCalling, tokenizer) -> StructuredOutputSpec | None:
    """The reply's structured output when it may hold calls (the format's markers as single tokens where
    the vocabulary has them), else None: the params keep their own."""
    return calling.spec(marker_token_ids(tokenizer, calling.fmt)) if calling.active else None


@dataclass(frozen=True)
class PreparedChat:
    prompts: list[tuple[str, list[int]]]
    """(prompt text, prompt ids) of each conversation."""
    calling: ToolCalling
    grammar: StructuredOutputSpec | None
    """The tool-call grammar every reply is constrained to, or None."""


def prepare_chat(tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]]], chat: ChatInput, *, backend: str,
                 parser: str = "auto", structured_param: str | None = None,
                 timeout: float | None = DEFAULT_RENDER_TIMEOUT, cancel: threading.Event | None = None) -> PreparedChat:
    """Conversations sharing one ChatInput -> their prompts, tool calling and grammar (tool_calling,
    render_chat and tool_grammar in turn; the arguments as theirs)."""
    calling = tool_calling(tokenizer, chat, backend=backend, parser=parser, structured_param=structured_param)
    prompts = [render_chat(tokenizer, c, chat, calling, timeout=timeout, cancel=cancel) for c in conversations]
    return PreparedChat(prompts, calling, tool_grammar(calling, tokenizer))


def fan_out(key: str, params: SamplingParams) -> list[SequenceRequest]:
    """The engine requests of one prompt: one per sequence, each with its own id and seed (see above)."""
    return [SequenceRequest(f"{key}-{j}", j, params.sequence_params(j)) for j in range(params.num_sequences)]
