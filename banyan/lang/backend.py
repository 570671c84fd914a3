"""The one interface a program runs on; banyan in process, a banyan server and any OpenAI server implement it.

A backend answers three calls, each from one program thread (many at once under run_batch and fork):
    generate(call, on_text)    text for a gen, streamed through on_text when given
    select(call)               the chosen option of a select, with its scores
    cache_prefix(prompt)       compute a prompt's pages now, so the branches or options that follow share them
and tells the program how the model writes chat roles (role_format).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from banyan.lang.chat import RoleFormat, probe_role_format
from banyan.lang.ir import SamplingOptions

DEFAULT_MAX_TOKENS = 128  # SGLang's max_new_tokens default


@dataclass
class GenCall:
    name: str  # how errors name the call: "gen('answer')"
    prompt: str
    sampling: SamplingOptions  # the program's defaults already applied
    regex: str | None = None
    json_schema: str | dict | None = None
    messages: list[dict] | None = None  # a backend on the chat API: the conversation, the open assistant turn last

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens if self.sampling.max_tokens is not None else DEFAULT_MAX_TOKENS


@dataclass
class SelectCall:
    name: str
    prompt: str
    choices: list[str]
    messages: list[dict] | None = None  # as GenCall's


@dataclass
class GenResult:
    text: str
    meta: dict[str, Any]  # SGLang's meta_info


@dataclass
class SelectResult:
    index: int
    meta: dict[str, Any] = field(default_factory=dict)


class Backend:
    """Base of the three backends: the chat format, probed once (thread-safe)."""

    def __init__(self):
        self._format: RoleFormat | None = None
        self._format_lock = threading.Lock()

    def role_format(self) -> RoleFormat:
        with self._format_lock:
            if self._format is None:
                self._format = probe_role_format(self.render_chat)
            return self._format

    @property
    def sends_messages(self) -> bool:
        """Whether programs with roles reach the model as chat messages (/v1/chat/completions, the server renders
        the template) rather than as the template's text: GenCall.messages and SelectCall.messages are then set."""
        return False

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template's text for `messages` (no generation prompt)."""
        raise NotImplementedError

    def generate(self, call: GenCall, on_text: Callable[[str], None] | None = None) -> GenResult:
        raise NotImplementedError

    def select(self, call: SelectCall) -> SelectResult:
        raise NotImplementedError

    def cache_prefix(self, prompt: str) -> None:
        raise NotImplementedError

    def add_callers(self, count: int) -> None:
        """`count` more programs now run together (negative: fewer), so a backend that batches can wait for
        each one's call before it starts a batch. The HTTP backends leave batching to the server."""

    def close(self) -> None:
        """Release what the backend holds (an engine, connections). Idempotent."""


# -- select by scores: what the backends that score options share ------------------------------------------
def option_start(prefix_ids: Sequence[int], full_ids: Sequence[int]) -> int:
    """Where an option's tokens begin in prefix + option: after the longest common prefix of the two
    tokenizations (the option's first token may merge with the prefix's last), leaving at least one token."""
    n = 0
    limit = min(len(prefix_ids), len(full_ids) - 1)
    while n < limit and prefix_ids[n] == full_ids[n]:
        n += 1
    return n


def choose_normalized(option_logprobs: list[list[float]], choices: list[str], prompt_tokens: int,
                      cached_tokens: int) -> SelectResult:
    """SGLang's token_length_normalized: the option whose tokens have the highest mean log-probability
    (ties: the first). The meta info holds every option's score and token log-probabilities."""
    normalized = [sum(lps) / len(lps) if lps else -math.inf for lps in option_logprobs]
    best = max(range(len(choices)), key=lambda i: normalized[i])
    meta = {
        "choices": list(choices),
        "chosen": choices[best],
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": option_logprobs,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "method": "token_length_normalized",
    }
    return SelectResult(best, meta)


def finish_reason_meta(finish_reason: str | None, stop_reason: Any, completion_tokens: int) -> dict | None:
    """SGLang's finish_reason: {"type": "stop", "matched": ...} or {"type": "length", "length": n}."""
    if finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    if finish_reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    return None if finish_reason is None else {"type": finish_reason}


def structured_outputs(call: GenCall) -> dict | None:
    """vLLM's structured_outputs for a gen's regex or json_schema (a schema given as a JSON string is parsed)."""
    if call.regex is not None:
        return {"regex": call.regex}
    if call.json_schema is not None:
        schema = call.json_schema
        return {"json": json.loads(schema) if isinstance(schema, str) else schema}
    return None
