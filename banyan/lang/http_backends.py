"""bl.RuntimeEndpoint (a banyan server) and bl.OpenAICompatible (any OpenAI-compatible server), over httpx.

Both send gens to /v1/completions as text (the state is text) and read chat roles from the server's own
chat template (/tokenize with messages, then /detokenize: vLLM's routes, which banyan and SGLang share).
They differ in select:

    RuntimeEndpoint    prefix + option token ids from /tokenize; one /v1/completions (echo, max_tokens 0,
                       logprobs) for all options with banyan's prompt_logprobs_start, so the prefix the
                       fork or select warmed comes from the prefix cache and only the options are computed
    OpenAICompatible   "choice": the server's constrained choice (structured_outputs, vLLM's and banyan's);
                       "logprobs": one /v1/completions (echo, max_tokens 0, logprobs) for the prefix and
                       every prefix + option, plain OpenAI; options start where their echoed tokens leave
                       the prefix's. "auto" picks "choice" for servers known to have it (vLLM, banyan).
"""

from __future__ import annotations

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
from banyan.lang.chat import ChatFormatError
from banyan.lang.errors import BackendError, BackendUnavailableError

logger = logging.getLogger("banyan.lang")

DEFAULT_TIMEOUT = 600.0
"""Seconds a call may wait for the server's answer (a longer generation is an error, never a hang)."""
SELECT_MODES = ("auto", "choice", "logprobs")
CHOICE_SERVERS = ("vllm", "banyan")  # /v1/models' owned_by of servers with structured_outputs.choice


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

    # -- HTTP ----------------------------------------------------------------------------------
    def post(self, call: str, url: str, body: dict) -> dict:
        try:
            response = self.http.post(url, json=body)
        except httpx.HTTPError as e:
            raise BackendUnavailableError(call, f"{url}: {e!r}") from e
        _raise_for_error(call, response)
        return response.json()

    def _stream(self, call: str, url: str, body: dict) -> Iterator[dict]:
        """The SSE chunks of a streamed answer; an error event or a cut connection raises."""
        try:
            with self.http.stream("POST", url, json=body) as response:
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
            ids = self.post("chat template", f"{self.root}/tokenize", body)["tokens"]
            return self.post("chat template", f"{self.root}/detokenize", {"model": self.model, "tokens": ids})["prompt"]
        except BackendError as e:
            raise ChatFormatError(f"the server did not render its chat template ({e}); roles need /tokenize with "
                                  "messages and /detokenize (vLLM's routes); plain-text programs need neither") from e

    def generate(self, call: GenCall, on_text: Callable[[str], None] | None = None) -> GenResult:
        started = time.monotonic()
        body = {"model": self.model, "prompt": call.prompt, **self._sampling(call)}
        url = f"{self.api_base}/completions"
        if on_text is None:
            answer = self.post(call.name, url, body)
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            text = choice["text"]
        else:
            text, choice, usage, answer = "", {}, {}, {}
            body.update(stream=True, stream_options={"include_usage": True})
            for chunk in self._stream(call.name, url, body):
                answer, usage = chunk, chunk.get("usage") or usage
                for piece in chunk.get("choices", ()):
                    text += piece.get("text") or ""
                    on_text(piece.get("text") or "")
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

    def _sampling(self, call: GenCall) -> dict[str, Any]:
        body = {k: v for k, v in call.sampling.given().items() if k != "max_tokens"}
        body["max_tokens"] = call.max_tokens
        structured = structured_outputs(call)
        if structured is not None:
            body["structured_outputs"] = structured
        return body

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
                 select_mode: str = "auto", timeout: float = DEFAULT_TIMEOUT):
        if select_mode not in SELECT_MODES:
            raise ValueError(f"select_mode must be one of {', '.join(SELECT_MODES)}, got {select_mode!r}")
        base_url = base_url.rstrip("/")
        super().__init__(base_url.removesuffix("/v1"), base_url, model, api_key, timeout)
        if select_mode == "auto":
            select_mode = "choice" if self.owned_by in CHOICE_SERVERS else "logprobs"
        self.select_mode = select_mode
        how = ("the server's constrained choice (structured_outputs.choice)" if select_mode == "choice"
               else "log-probability scoring through echo + logprobs (token_length_normalized)")
        logger.info("banyan.lang: select on %s (%s) uses %s", base_url, self.owned_by or "unknown server", how)

    def select(self, call: SelectCall) -> SelectResult:
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
        body = {"model": self.model, "prompt": call.prompt, "max_tokens": 256, "temperature": 0.0,
                "structured_outputs": {"choice": call.choices}}
        answer = self.post(call.name, f"{self.api_base}/completions", body)
        text = answer["choices"][0]["text"]
        if text not in call.choices:
            raise BackendError(call.name, f"the server's constrained choice answered {text[:80]!r}, not an option")
        usage = answer.get("usage") or {}
        return SelectResult(call.choices.index(text), {
            "choices": list(call.choices), "chosen": text, "method": "constrained_choice",
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        })


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
