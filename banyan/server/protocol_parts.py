"""The pieces OpenAI's request bodies are made of (messages, tools, response formats, stream options),
the strict base models every body and piece is built on, and the server's caps on sizes.

protocol.py builds the request bodies from these.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from banyan.errors import InvalidParameterError
from banyan.sampling_params import INT64_MAX, INT64_MIN
from banyan.structured import StructuredOutputError, StructuredOutputSpec

logger = logging.getLogger("banyan.server.protocol")

MAX_PROMPTS = 256
"""Prompts in one completions request (CVE-2026-73559)."""
MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are checked against the model's vocabulary later; this only bounds them."""
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
CACHE_SALT_PATTERN = r"^[A-Za-z0-9_.:-]{1,256}$"
UNSUPPORTED_PARTS = ("image_url", "input_audio", "image", "audio", "input_image", "video_url", "file", "refusal")

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


class RequestModel(StrictModel):
    """A request body: `null` means the default (except for max_tokens); unknown fields are ignored."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = data.keys() - cls.model_fields.keys()
        if unknown:
            logger.debug("%s: ignoring unknown fields %s", cls.__name__, sorted(unknown)[:20])
        return {k: v for k, v in data.items() if v is not None or k == "max_tokens"}


# -- pieces of requests ---------------------------------------------------------------------------
class SloTargets(StrictModel):
    """Latency targets of one request (banyan's extension), in milliseconds; unset: the server's defaults."""

    ttft_ms: float | None = Field(None, gt=0.0, le=86_400_000.0)
    """Time to first token, from the request's arrival."""
    tpot_ms: float | None = Field(None, gt=0.0, le=86_400_000.0)
    """Time per output token after the first."""


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    """A last chunk, with no choices, carries the usage."""
    continuous_usage_stats: bool | None = None
    """Every chunk carries the usage so far (vLLM's); implies include_usage."""


class FunctionCall(StrictModel):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(StrictModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessageParam(StrictModel):
    """One message of a chat: text content only (a string or a list of text parts)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list) or not content:
            raise InvalidParameterError("", "must be a string or a non-empty list of content parts")
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in UNSUPPORTED_PARTS:
                raise InvalidParameterError(f"[{i}].type", f"content parts of type {kind!r} are not supported")
            if kind != "text":
                raise InvalidParameterError(f"[{i}]", 'must be an object {"type": "text", "text": "..."}')
            if not isinstance(part.get("text"), str):
                raise InvalidParameterError(f"[{i}].text", "must be a string")
        return content

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessageParam:
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidParameterError("tool_call_id", "is required in a message with role 'tool'")
        if self.tool_calls and self.role != "assistant":
            raise InvalidParameterError("tool_calls", "only messages with role 'assistant' have tool calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidParameterError("content", "is required (null only in an assistant message with tool_calls)")
        return self


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """{"name", "schema", "strict", "description"}; `strict` changes nothing: output always validates."""

    def spec(self) -> StructuredOutputSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputSpec.json_object()
        if self.json_schema is None or not isinstance(self.json_schema.get("name"), str):
            raise StructuredOutputError("response_format", "json_schema needs a `name` and a `schema`")
        schema = self.json_schema.get("schema")
        if not isinstance(schema, dict):
            raise StructuredOutputError("response_format", "json_schema.schema must be a JSON Schema object")
        return StructuredOutputSpec.json(schema)


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip
