"""OpenAI's request and response shapes as pydantic models, with OpenAI's ranges and the server's caps.

Requests are validated strictly (no "1" for 1, no true for 1, finite numbers only); unknown top-level
fields are ignored (logged at debug), never passed on. A JSON `null` means "the default" for every
field except `max_tokens`, where it means "as many as the context allows". Validators raise
InvalidParameterError naming the field relative to where they run, so `from_validation_error` can
report `param` as a full path like `messages[2].tool_call_id`. The pieces bodies are made of (messages,
tools, response formats) and the size caps are in protocol_parts.py.

    body bytes --parse_json_body--> dict --parse--> CompletionRequest | ChatCompletionRequest
               --to_sampling_params--> SamplingParams          (messages_for_template: chat -> template input)
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from banyan.errors import InvalidParameterError
from banyan.sampling_params import INT64_MAX, MAX_N, MAX_STOP_STRING_LEN, SamplingParams
from banyan.server.errors import MAX_JSON_DEPTH, from_validation_error
from banyan.server.protocol_parts import (  # noqa: F401 (the pieces are part of protocol's vocabulary)
    CACHE_SALT_PATTERN, MAX_COMPLETION_LOGPROBS, MAX_LOGIT_BIAS, MAX_PROMPTS, MAX_STOP, MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID, MAX_TOP_LOGPROBS, STRUCTURED_FIELDS, ChatMessageParam, FunctionCall, FunctionDefinition, Int64,
    NamedFunction, NamedToolChoice, Penalty, Probability, RequestModel, ResponseFormat, StreamOptions, TextPart, Tool,
    SloTargets, TokenId, ToolCall,
)
from banyan.structured import StructuredOutputError, StructuredOutputSpec
from banyan.text.chat_template import RESERVED_TEMPLATE_KWARGS

# -- requests -------------------------------------------------------------------------------------
class _SamplingFields(RequestModel):
    """What completions and chat completions share: sampling, stopping, streaming, and vLLM's extras."""

    model: str | None = None
    """None: the served model."""
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN)]] | None = Field(
        None, max_length=MAX_STOP)
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(None, pattern=CACHE_SALT_PATTERN)
    """Namespace of the prefix cache (from a trusted gateway); letters, digits and _.:- only."""
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    """Scheduling priority, lower served first, under `--scheduling-policy priority`; under the default fcfs
    policy (arrival order) it is accepted and has no effect, as in vLLM."""
    slo: SloTargets | None = None
    """banyan's extension: latency targets. Under `--scheduling-policy slo` waiting requests go earliest deadline
    first (fair across API keys), and a request the queue would make miss its targets is refused at once: 503,
    code slo_unattainable, with Retry-After. The other policies ignore it."""
    # structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _structured: tuple[str, StructuredOutputSpec] | None = PrivateAttr(None)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in logit_bias or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
                shown = key if len(key) <= 20 else key[:17] + "..."
                raise InvalidParameterError(
                    "", f"keys must be token ids (integers in [0, {MAX_TOKEN_ID}]), got {shown!r}")
        return logit_bias

    @model_validator(mode="after")
    def _structured_spec(self):
        """At most one structured-output field; its spec is checked here (400 naming the field)."""
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise InvalidParameterError(given[1], f"cannot be combined with {given[0]}")
        if given:
            try:
                self._structured = (given[0], _spec_of(given[0], getattr(self, given[0])))
            except StructuredOutputError as e:
                raise e.with_param(given[0]) from None
        return self

    @property
    def structured_param(self) -> str | None:
        """The request field the structured-output spec came from (errors about it name it)."""
        return self._structured[0] if self._structured else None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options", "is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    """One prompt or a batch of them, as text or token ids."""
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    """0 with echo: score the prompt without generating (the prompt's log-probabilities, as vLLM)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    """The prompt before the completion; with logprobs, the prompt's positions too (the first one null)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """vLLM's: each choice's `prompt_logprobs`, per prompt position (null first) the prompt token and the top ones."""
    prompt_logprobs_start: int = Field(0, ge=0, le=INT64_MAX)
    """banyan's (SGLang's logprob_start_len): prompt positions before it report null and may come from the
    prefix cache; without it a request for prompt log-probabilities computes its whole prompt."""
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """Completions to generate, of which the n with the highest cumulative log-probability are returned
    (at least n; not with stream). Usage counts every generated token."""

    @model_validator(mode="before")
    @classmethod
    def _no_prompt_embeds(cls, data: Any) -> Any:
        # vLLM's prompt_embeds: refused rather than ignored, before `prompt` is found missing (RELIABILITY T7)
        if isinstance(data, dict) and data.get("prompt_embeds") is not None:
            raise InvalidParameterError("prompt_embeds", "is not supported")
        return data

    @field_validator("prompt", mode="plain",  # the whole validation: pydantic's union is slow on long lists
                     json_schema_input_type=str | list[str] | list[TokenId] | list[list[TokenId]])
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        return check_prompts(prompt)

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix is not None:
            raise InvalidParameterError("suffix", "is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameterError("max_tokens", "0 is only allowed with echo (scoring the prompt)")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidParameterError("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidParameterError("best_of", "cannot be used with stream: the best are known only at the end")
        return self

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its log-probabilities, nothing generated."""
        return self.max_tokens == 0

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """Top log-probabilities per prompt position the engine computes: prompt_logprobs's, and with echo
        and logprobs the echoed prompt's."""
        echoed = self.logprobs if self.echo else None
        given = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(given) if given else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a batch: each one a text or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class _ChatTemplateFields(RequestModel):
    """What rendering a chat needs: the messages and the chat template's inputs."""

    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    """A template sent with the request: refused unless the server allows it (RELIABILITY M1)."""
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
        if reserved:
            raise InvalidParameterError("", f"cannot set {', '.join(reserved)}: the server sets them")
        return kwargs

    @model_validator(mode="after")
    def _start_or_continue(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidParameterError(
                "continue_final_message", "cannot be combined with add_generation_prompt (start or continue a message)")
        return self


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    """Wins over max_tokens (its newer name)."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, choice: Any) -> Any:
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)
        if not (named or choice in ("none", "auto", "required")):
            raise InvalidParameterError(
                "", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return choice

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "requires logprobs to be true")
        return self


def _spec_of(field: str, value: Any) -> StructuredOutputSpec:
    if field == "response_format":
        return value.spec()
    if field == "structured_outputs":
        return StructuredOutputSpec.from_dict(value)
    return StructuredOutputSpec.from_dict({field.removeprefix("guided_"): value})


PromptsInput = str | list[str] | list[TokenId] | list[list[TokenId]]


def check_prompts(prompt: Any) -> Any:
    """One prompt or a batch of them, as text or token ids (completions' `prompt`, embeddings' `input`): non-empty,
    at most MAX_PROMPTS, token ids in range; InvalidParameterError relative to the field."""
    if isinstance(prompt, str):
        return _check_text_prompt("", prompt)
    if not isinstance(prompt, list) or not prompt:
        raise InvalidParameterError("", "must be a non-empty string, list of strings, or list of token ids")
    if all(isinstance(p, list) for p in prompt):
        _check_prompt_count(prompt)
        for i, ids in enumerate(prompt):
            _check_token_ids(f"[{i}]", ids)
    elif all(isinstance(p, str) for p in prompt):
        _check_prompt_count(prompt)
        for i, text in enumerate(prompt):
            _check_text_prompt(f"[{i}]", text)
    else:
        _check_token_ids("", prompt)
    return prompt


def _check_text_prompt(param: str, text: str) -> str:
    if not text:
        raise InvalidParameterError(param, "a prompt must not be empty")
    return text


def _check_prompt_count(prompts: list) -> None:
    if len(prompts) > MAX_PROMPTS:
        raise InvalidParameterError("", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")


def _check_token_ids(param: str, ids: list) -> None:
    if not ids:
        raise InvalidParameterError(param, "a prompt must not be empty")
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) <= MAX_TOKEN_ID:
        return  # the common case, checked in C
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            shown = repr(t)[:40]
            raise InvalidParameterError(
                f"{param}[{i}]", f"token ids must be integers in [0, {MAX_TOKEN_ID}], got {shown}")


def _template_message(message: ChatMessageParam) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        out["content"] = "\n".join(part.text for part in message.content)
    for call in out.get("tool_calls", ()):
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (ValueError, RecursionError):
            continue
        if isinstance(arguments, dict) and _depth_at_most(arguments, MAX_JSON_DEPTH):
            call["function"]["arguments"] = arguments
    return out


def _depth_at_most(value: Any, limit: int) -> bool:
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return False
        level = [v for node in level for v in (node.values() if isinstance(node, dict) else node)
                 if isinstance(v, (dict, list))]
    return True


# -- to the engine --------------------------------------------------------------------------------
Req = TypeVar("Req", bound=BaseModel)


def parse(model: type[Req], data: dict) -> Req:
    """A request of type `model` from a body `parse_json_body` returned; APIError (400) naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def messages_for_template(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: text parts joined into one string, tool-call
    arguments parsed from JSON where they are a JSON object, null fields left out."""
    return [_template_message(m) for m in messages]


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, *,
                       default_max_tokens: int | None) -> SamplingParams:
    """How to sample for the request. `default_max_tokens` applies when the request sets no limit
    (None: up to the context length). Raises InvalidParameterError (param kept) for combinations
    SamplingParams refuses."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt_logprobs = None
    else:  # max_tokens 0 (echo, scores only): the engine samples one token, which the answer leaves out
        max_tokens, logprobs = (1 if request.scores_only else request.max_tokens), request.logprobs
        prompt_logprobs = request.wanted_prompt_logprobs
    optional = {name: getattr(request, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
    return SamplingParams(
        n=request.n,
        best_of=getattr(request, "best_of", None),
        seed=request.seed,
        stop=request.stop or [],
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        prompt_logprobs_start=getattr(request, "prompt_logprobs_start", 0),
        logit_bias={int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        structured_outputs=request._structured[1] if request._structured else None,
        **{k: v for k, v in optional.items() if v is not None},
    )


# -- responses ------------------------------------------------------------------------------------
# Responses are built as plain dicts by serving.py (OpenAI's shapes; the official client parses
# them in the end-to-end tests), so only the request side is modelled here.


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_ChatTemplateFields):
    add_special_tokens: bool = False
    """The chat template writes the special tokens itself."""


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]
