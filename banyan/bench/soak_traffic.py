"""The soak's traffic: random streamed requests, and the check of every answer that came back whole.

Each request draws, from one seeded generator: chat or completion, a prompt of 1-60 words, 1-48 output tokens,
sampling (greedy against a reference, or temperature / top_p / top_k / penalties with a seed), sometimes n = 2-3,
logprobs, or a structured output (a JSON schema, a regex, a choice), and maybe a disconnect at a random point
(before the first byte of the answer: mid-prefill; or after k events: mid-stream).

A whole answer is checked (`check_stream`): every line `data: <json>`, the last `data: [DONE]`; each choice ends
once with a finish_reason; no error event; the usage chunk's completion_tokens equals the tokens streamed where that
count is exact (every token's logprob was asked for, or every choice ran to max_tokens); a greedy request's text
equals its reference (computed alone before the soak); a structured output that stopped matches its spec.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex our jolly banyan tree near "
         "river stones and bright paper lanterns glow above calm water").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = "[a-z]{2,6}( [a-z]{2,6}){0,2}"
CHOICES = ["yes", "no", "maybe"]
GREEDY_MAX_TOKENS = 24


@dataclass
class Planned:
    """One request to send: its path and body, what to check, and where the client leaves (None: it reads all)."""

    path: str
    body: dict
    greedy_key: int | None = None  # index of its reference prompt
    structured: str | None = None  # "json" | "regex" | "choice"
    leave_after_events: int | None = None  # 0: before the answer's first byte (mid-prefill)
    leave_after_ms: float = 0.0  # with leave_after_events 0: how long it waits for the answer first


@dataclass
class Outcome:
    """What became of one request."""

    status: int | None = None  # HTTP status, None: no answer (a transport error, or it left first)
    left: bool = False  # the client disconnected on purpose
    problems: list[str] = field(default_factory=list)  # mangled: what the check found
    error_code: str | None = None  # an error event's or an error body's code
    transport_error: str | None = None
    completion_tokens: int = 0


def greedy_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed ^ 0x5EED)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24))) for _ in range(count)]


def greedy_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


class Traffic:
    """Random requests from one seed; `greedy` holds the reference prompts (their texts are filled in later)."""

    def __init__(self, seed: int, disconnect_rate: float, num_greedy: int = 16):
        self.rng = random.Random(seed)
        self.disconnect_rate = disconnect_rate
        self.greedy = greedy_prompts(num_greedy, seed)

    def next(self) -> Planned:
        rng = self.rng
        roll = rng.random()
        if roll < 0.2:
            key = rng.randrange(len(self.greedy))
            planned = Planned("/v1/completions", greedy_body(self.greedy[key]), greedy_key=key)
        elif roll < 0.35:
            planned = self._structured()
        else:
            planned = self._sampled()
        planned.body |= {"stream": True, "stream_options": {"include_usage": True}}
        if rng.random() < self.disconnect_rate:
            planned.leave_after_events = rng.choice([0, rng.randint(1, 12)])
            planned.leave_after_ms = rng.uniform(0, 50)
        return planned

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 60)))

    def _sampled(self) -> Planned:
        rng = self.rng
        body = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.7, 1.0]), "seed": rng.randrange(1 << 30),
                "n": rng.choice([1, 1, 1, 2, 3]), "ignore_eos": rng.random() < 0.5}
        for name, value in (("top_p", rng.uniform(0.5, 1.0)), ("top_k", rng.randint(1, 50)),
                            ("presence_penalty", rng.uniform(-1, 1)), ("frequency_penalty", rng.uniform(-1, 1))):
            if rng.random() < 0.3:
                body[name] = value
        chat = rng.random() < 0.5
        if rng.random() < 0.3:
            body["logprobs"] = True if chat else 1
        if chat:
            return Planned("/v1/chat/completions", body | {"messages": [{"role": "user", "content": self._prompt()}]})
        return Planned("/v1/completions", body | {"prompt": self._prompt()})

    def _structured(self) -> Planned:
        rng = self.rng
        kind = rng.choice(["json", "regex", "choice"])
        spec = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}}[kind]
        body = {"max_tokens": 48, "temperature": 1.0, "seed": rng.randrange(1 << 30), "n": rng.choice([1, 2])}
        if kind == "json" and rng.random() < 0.5:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            return Planned("/v1/chat/completions", body | {"messages": [{"role": "user", "content": self._prompt()}]},
                           structured=kind)
        return Planned("/v1/completions", body | {"prompt": self._prompt(), "structured_outputs": spec}, structured=kind)


def check_stream(planned: Planned, lines: list[str], references: list[str | None]) -> tuple[list[str], str | None, int]:
    """(problems, error code, completion tokens) of one whole streamed answer (module docstring)."""
    if not lines or lines[-1] != "data: [DONE]":
        return ["the stream did not end with data: [DONE]"], None, 0
    events, problems = [], []
    for line in lines[:-1]:
        if not line.startswith("data: "):
            return [f"not an SSE data line: {line[:60]!r}"], None, 0
        try:
            events.append(json.loads(line[6:]))
        except ValueError:
            return [f"not JSON ({len(line)} chars): {line[:60]!r} ... {line[-120:]!r}"], None, 0
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        return [], errors[0].get("code") or errors[0].get("type"), 0
    chat = planned.path.endswith("chat/completions")
    n = planned.body.get("n", 1)
    texts, finishes, counted = [""] * n, [None] * n, [0] * n
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            i = choice["index"]
            if finishes[i] is not None:
                problems.append(f"choice {i} streamed after its finish_reason")
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            texts[i] += piece or ""
            counted[i] += _logprob_count(choice, chat)
            finishes[i] = choice.get("finish_reason") or finishes[i]
    if None in finishes:
        problems.append(f"choices without a finish_reason: {[i for i, f in enumerate(finishes) if f is None]}")
    if usage is None:
        return problems + ["no usage chunk"], None, 0
    tokens = usage["completion_tokens"]
    exact = _exact_count(planned, finishes, counted)
    if exact is not None and tokens != exact:
        problems.append(f"usage says {tokens} completion tokens, {exact} were streamed")
    if planned.greedy_key is not None and references[planned.greedy_key] is not None:
        if texts[0] != references[planned.greedy_key]:
            problems.append(f"greedy output differs from its reference: {texts[0][:40]!r}")
    if planned.structured is not None:
        problems += [p for text, f in zip(texts, finishes) if f == "stop" for p in _structure_problems(planned, text)]
    return problems, None, tokens


def _logprob_count(choice: dict, chat: bool) -> int:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return 0
    return len(logprobs.get("content") or ()) if chat else len(logprobs.get("tokens") or ())


def _exact_count(planned: Planned, finishes: list, counted: list[int]) -> int | None:
    """Tokens the stream shows exactly: one logprob each, or max_tokens per choice when every one hit it."""
    if planned.body.get("logprobs"):
        return sum(counted)
    if all(f == "length" for f in finishes):
        return planned.body["max_tokens"] * len(finishes)
    return None


def _structure_problems(planned: Planned, text: str) -> list[str]:
    if planned.structured == "choice":
        return [] if text in CHOICES else [f"not one of the choices: {text[:40]!r}"]
    if planned.structured == "regex":
        return [] if re.fullmatch(REGEX, text) else [f"does not match the regex: {text[:40]!r}"]
    try:
        value = json.loads(text)
    except ValueError:
        return [f"not JSON: {text[:40]!r}"]
    ok = isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str) and \
        isinstance(value["age"], int) and 0 <= value["age"] <= 99
    return [] if ok else [f"does not follow the schema: {text[:40]!r}"]
