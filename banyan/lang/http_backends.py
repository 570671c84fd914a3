"""bl.RuntimeEndpoint (a banyan server) and bl.OpenAICompatible (any OpenAI-compatible server), over httpx.

Both send gens to /v1/completions as text (the state is text) and read chat roles from the server's own
chat template (/tokenize with messages, then /detokenize: vLLM's routes, which banyan and SGLang share).
They differ in select:

    RuntimeEndpoint    prefix + option token ids from /tokenize; one /v1/completions (echo, max_tokens 0,
                       logprobs) for all options with banyan's prompt_logprobs_start, so the prefix the
                       fork or select warmed comes from the prefix cache and only the options are computed
    OpenAICompatible   "choice": the server's constrained choice, in its dialect (lang/constraints.py:
                       structured_outputs for vLLM and banyan, a GBNF grammar for llama-server, a JSON
                       schema's enum elsewhere); "logprobs": one /v1/completions (echo, max_tokens 0,
                       logprobs) for the prefix and every prefix + option, plain OpenAI; options start where
                       their echoed tokens leave the prefix's. "auto" picks "choice" for servers known to
                       have one (vLLM, banyan, llama-server, which has no echo), else "logprobs".

Constrained gens (regex, json_schema) go in the server's dialect too (lang/constraints.py).

OpenAICompatible can also send a program's roles as messages to /v1/chat/completions (`api="chat"`, or "auto" on a
server that does not render its template through /tokenize: OpenAI itself, llama-server), as SGLang's OpenAI backend
does for chat models: then the server applies the template, gens and selects run inside assistant turns only, and
an assistant turn that already holds text is continued with vLLM's `continue_final_message`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from banyan.lang.backend import (
    Backend, GenCall, GenResult, SelectCall, SelectResult, choose_normalized, finish_reason_meta, option_start,
    structured_outputs,
)
from banyan.lang.chat import CHAT_API_FORMAT, ChatFormatError, RoleFormat
from banyan.lang.constraints import choice_fields, chosen, dialect_of, gen_fields
from banyan.lang.errors import BackendError, BackendUnavailableError

logger = logging.getLogger("banyan.lang")

DEFAULT_TIMEOUT = 600.0
"""Seconds a call may wait for the server's answer (a longer generation is an error, never a hang)."""
SELECT_MODES = ("auto", "choice", "logprobs")
APIS = ("auto", "completions", "chat")


class _HTTPBackend(Backend):
    def __init__(self, root: str, api_base: str, model: str | None, api_key: str | None, timeout: float):
        super().__init__()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.root, self.api_base = root.rstrip("/"), api_base.rstrip("/")
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        card = self._models()[0]
        self.model = model or card["id"]
        self.owned_by = card.get("owned_by", "")
        self.dialect = dialect_of(self.owned_by)  # how it takes constraints (lang/constraints.py)

    # -- HTTP ----------------------------------------------------------------------------------
    def _send(self, url: str, body: dict, stream: bool = False) -> httpx.Response:
        """POST body to url. A kept-alive connection the server had closed (llama-server does after 5 s idle) raises
        RemoteProtocolError before anything was answered: the request goes once more, on a new connection."""
        try:
            return self.http.send(self.http.build_request("POST", url, json=body), stream=stream)
        except httpx.RemoteProtocolError:
            return self.http.send(self.http.build_request("POST", url, json=body), stream=stream)

    def post(self, call: str, url: str, body: dict) -> dict:
        try:
            response = self._send(url, body)
        except httpx.HTTPError as e:
            raise BackendUnavailableError(call, f"{url}: {e!r}") from e
        _raise_for_error(call, response)
        return response.json()

    def _stream(self, call: str, url: str, body: dict) -> Iterator[dict]:
        """The SSE chunks of a streamed answer; an error event or a cut connection raises."""
        try:
            with contextlib.closing(self._send(url, body, stream=True)) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_error(call, response)
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise _backend_error(call, chunk["error"], None)
                    yield chunk
        except httpx.HTTPError as e:
            raise BackendUnavailableError(call, f"{url}: {e!r}") from e

    def _models(self) -> list[dict]:
        try:
            response = self.http.get(f"{self.api_base}/models")
        except httpx.HTTPError as e:
            raise BackendUnavailableError("connect", f"{self.api_base}/models: {e!r}") from e
        _raise_for_error("connect", response)
        return response.json()["data"]

    # -- the backend calls ---------------------------------------------------------------------
    def render_chat(self, messages: list[dict]) -> str:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": False}
        try:
            ids = self.post("chat template", f"{self.root}/tokenize", body).get("tokens")
            # llama-server has both routes, but tokenizes no messages and detokenizes into "content"
            rendered = self.post("chat template", f"{self.root}/detokenize", {"model": self.model, "tokens": ids}
                                 ).get("prompt") if ids else None
            if not isinstance(rendered, str):
                raise BackendError("chat template", "its /tokenize and /detokenize do not answer as vLLM's do "
                                   "(tokens of the messages, then a prompt)")
            return rendered
        except BackendError as e:
            raise ChatFormatError(f"the server did not render its chat template ({e}); roles need /tokenize with "
                                  "messages and /detokenize (vLLM's routes); plain-text programs need neither") from e

    def generate(self, call: GenCall, on_text: Callable[[str], None] | None = None) -> GenResult:
        started = time.monotonic()
        if call.messages is None:
            body, url = {"model": self.model, "prompt": call.prompt, **self._sampling(call, chat=False)}, \
                f"{self.api_base}/completions"
        else:
            body, url = {**chat_body(self.model, call.messages), **self._sampling(call, chat=True)}, \
                f"{self.api_base}/chat/completions"
        if on_text is None:
            answer = self.post(call.name, url, body)
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            text = choice_text(choice)
        else:
            text, choice, usage, answer = "", {}, {}, {}
            body.update(stream=True, stream_options={"include_usage": True})
            for chunk in self._stream(call.name, url, body):
                answer, usage = chunk, chunk.get("usage") or usage
                for piece in chunk.get("choices", ()):
                    text += choice_text(piece)
                    on_text(choice_text(piece))
                    choice = {**choice, **{k: v for k, v in piece.items() if v is not None}}
        completion_tokens = usage.get("completion_tokens", 0)
        return GenResult(text, {
            "id": answer.get("id"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": completion_tokens,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "finish_reason": finish_reason_meta(choice.get("finish_reason"), choice.get("stop_reason"), completion_tokens),
            "e2e_latency": time.monotonic() - started,
        })

    def cache_prefix(self, prompt: str) -> None:
        self.post("fork", f"{self.api_base}/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                            "temperature": 0.0})

    def close(self) -> None:
        self.http.close()

    def _sampling(self, call: GenCall, chat: bool) -> dict[str, Any]:
        body = {k: v for k, v in call.sampling.given().items() if k != "max_tokens"}
        body["max_tokens"] = call.max_tokens
        return body | gen_fields(self.dialect, call.name, structured_outputs(call), chat)

    def _score(self, call: str, prompts: list, extra: dict) -> list[dict]:
        """Each prompt's echoed legacy logprobs (tokens, token_logprobs), nothing generated."""
        body = {"model": self.model, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0, **extra}
        choices = sorted(self.post(call, f"{self.api_base}/completions", body)["choices"], key=lambda c: c["index"])
        return [c["logprobs"] for c in choices]


class RuntimeEndpoint(_HTTPBackend):
    """A `banyan serve` server: `bl.RuntimeEndpoint("http://host:port", api_key=None)`."""

    def __init__(self, url: str, api_key: str | None = None, *, model: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT):
        super().__init__(url, f"{url.rstrip('/')}/v1", model, api_key, timeout)

    def select(self, call: SelectCall) -> SelectResult:
        prefix = self._tokenize(call.name, call.prompt)
        fulls = [self._tokenize(call.name, call.prompt + choice) for choice in call.choices]
        starts = [option_start(prefix, full) for full in fulls]
        positions = self._score(call.name, fulls, {"prompt_logprobs_start": min(starts)})
        scores = [p["token_logprobs"][start:] for p, start in zip(positions, starts)]
        # positions the cache served report null, as does the first
        cached = min(sum(1 for v in p["token_logprobs"] if v is None) - 1 for p in positions)
        return choose_normalized(scores, call.choices, len(prefix), cached)

    def _tokenize(self, call: str, text: str) -> list[int]:
        return self.post(call, f"{self.root}/tokenize", {"model": self.model, "prompt": text})["tokens"]


class OpenAICompatible(_HTTPBackend):
    """Any OpenAI-compatible server: `bl.OpenAICompatible("http://host:port/v1", model, api_key=None)`.
    `select_mode`: "choice" (the server's constrained choice), "logprobs" (echo + logprobs scoring), or
    "auto" (choice on servers known to have it). Uses no banyan-only field."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, *,
                 select_mode: str = "auto", api: str = "auto", timeout: float = DEFAULT_TIMEOUT):
        """api: how programs with roles reach the model: "completions" (the template's text, read from the
        server's /tokenize), "chat" (messages to /v1/chat/completions), or "auto" (completions where the server
        renders its template through /tokenize, else chat)."""
        if select_mode not in SELECT_MODES:
            raise ValueError(f"select_mode must be one of {', '.join(SELECT_MODES)}, got {select_mode!r}")
        if api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
        self.api = api
        base_url = base_url.rstrip("/")
        super().__init__(base_url.removesuffix("/v1"), base_url, model, api_key, timeout)
        if select_mode == "auto":
            select_mode = "choice" if self.dialect != "openai" else "logprobs"  # llama-server: no echo
        self.select_mode = select_mode
        fields = ", ".join(choice_fields(self.dialect, []))
        how = (f"the server's constrained choice ({fields})" if select_mode == "choice"
               else "log-probability scoring through echo + logprobs (token_length_normalized)")
        logger.info("banyan.lang: select on %s (%s) uses %s", base_url, self.owned_by or "unknown server", how)

    def role_format(self) -> RoleFormat:
        if self.api == "chat":
            return CHAT_API_FORMAT
        if self.api == "auto":
            try:
                return super().role_format()
            except ChatFormatError as e:
                logger.info("banyan.lang: %s renders no chat template here (%s); roles go to /v1/chat/completions",
                            self.api_base, e)
                self.api = "chat"
                return CHAT_API_FORMAT
        return super().role_format()

    @property
    def sends_messages(self) -> bool:
        return self.role_format() is CHAT_API_FORMAT

    def select(self, call: SelectCall) -> SelectResult:
        if call.messages is not None:
            return self._select_by_choice(call)  # a chat answer has no echo to score options with
        if self.select_mode == "choice":
            return self._select_by_choice(call)
        positions = self._score(call.name, [call.prompt] + [call.prompt + c for c in call.choices], {})
        prefix_tokens = positions[0]["tokens"]
        scores = []
        for p in positions[1:]:
            start = option_start(prefix_tokens, p["tokens"])
            scores.append(p["token_logprobs"][start:])
        return choose_normalized(scores, call.choices, len(prefix_tokens), 0)

    def _select_by_choice(self, call: SelectCall) -> SelectResult:
        body = {"max_tokens": 256, "temperature": 0.0, **choice_fields(self.dialect, call.choices)}
        if call.messages is None:
            body.update(model=self.model, prompt=call.prompt)
            answer = self.post(call.name, f"{self.api_base}/completions", body)
        else:
            answer = self.post(call.name, f"{self.api_base}/chat/completions", {**chat_body(self.model, call.messages), **body})
        text = chosen(self.dialect, choice_text(answer["choices"][0]))
        if text not in call.choices:
            raise BackendError(call.name, f"the server's constrained choice answered {text[:80]!r}, not an option")
        usage = answer.get("usage") or {}
        return SelectResult(call.choices.index(text), {
            "choices": list(call.choices), "chosen": text, "method": "constrained_choice",
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        })


def chat_body(model: str, messages: list[dict]) -> dict:
    """A chat completion's messages: the open assistant turn (last) is continued when it holds text (vLLM's
    continue_final_message), else the server's generation prompt starts it."""
    *before, turn = messages
    if turn["content"]:
        return {"model": model, "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    return {"model": model, "messages": before}


def choice_text(choice: dict) -> str:
    """The text of a completion's choice, a chat completion's message, or a streamed chunk of either."""
    if "text" in choice:
        return choice["text"] or ""
    return ((choice.get("message") or choice.get("delta") or {}).get("content")) or ""


def _raise_for_error(call: str, response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {"message": response.text[:500]}
    raise _backend_error(call, error, response.status_code)


def _backend_error(call: str, error: dict, status: int | None) -> BackendError:
    cls = BackendUnavailableError if status in (502, 503, 504) else BackendError
    return cls(call, str(error.get("message", "")), status=status, type=error.get("type"), code=error.get("code"),
               param=error.get("param"))
