"""Reasoning models: their thinking, between markers, split from the answer (`--reasoning-parser`).

    qwen3        <think> reasoning </think> answer      reasoning only where the reply opens with <think>
                                                          (or the prompt left one open); else all answer
    deepseek_r1  reasoning </think> answer              the template opens <think> in the prompt, so the reply
                                                          starts inside it; no </think>: all reasoning

    fmt = REASONING_PARSERS.get("qwen3")
    split = ReasoningSplitter(fmt, prompt_open=fmt.open_in(prompt_text))    # or: splitters(name, prompt_text)()
    reasoning, content = split.feed(text_delta)      # per streamed piece of text (markers never leak)
    reasoning, content = split.finish()              # at the end: text held back as a possible marker
    split.reasoning, split.content                   # everything so far

A marker split across two pieces is held back until it is decided. The engine reads the end marker's token id
(`end_token_id`) to start a request's grammar only after the reasoning (engine/grammar.py): the thinking stays
free, the answer follows the structured output or the tools' grammar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from banyan.registry import Registry


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_open: bool = False
    """The reply starts inside the reasoning (the chat template wrote the start marker into the prompt)."""

    def open_in(self, prompt: str) -> bool:
        """Whether a reply to `prompt` starts inside the reasoning: the prompt's last marker is a start marker, or
        the format says so and the prompt did not close it."""
        return prompt.rfind(self.start) > prompt.rfind(self.end) or self.starts_open and not self.ended_in(prompt)

    def ended_in(self, prompt: str) -> bool:
        """Whether the prompt already closed the reasoning (its last marker is the end marker: e.g. Qwen3's
        template with enable_thinking false writes an empty <think></think>)."""
        return prompt.rfind(self.end) > prompt.rfind(self.start)

    def grammar_gate(self, tokenizer) -> GrammarGate | None:
        """The markers' token ids where both are single tokens of the vocabulary (gating needs them), else None."""
        start, end = (tokenizer.encode(m, add_special_tokens=False) for m in (self.start, self.end))
        return GrammarGate(start[0], end[0], self.starts_open) if len(start) == len(end) == 1 else None


@dataclass(frozen=True)
class GrammarGate:
    """The engine's side: a constrained request's grammar waits for the end-of-thinking token (its mask applies,
    its matcher advances, only after it), as the splitter reads the reply:

        the prompt's last marker is the end marker         -> no reasoning: the grammar from the first token
        its last marker is a start marker (or starts_open) -> the grammar waits for the end token
        no marker, reasoning opened by the reply (qwen3)   -> the first token may be the start token besides what
                                                              the grammar allows; it decides which of the two
    """

    start_id: int
    end_id: int
    starts_open: bool = False

    def for_prompt(self, prompt_token_ids) -> tuple[int | None, tuple[int, int] | None]:
        """(the token the grammar waits for, or None; (start, end) when the first output token decides)."""
        last = {t: i for i, t in enumerate(prompt_token_ids) if t in (self.start_id, self.end_id)}
        start, end = last.get(self.start_id, -1), last.get(self.end_id, -1)
        if end > start:
            return None, None
        if start > end or self.starts_open:
            return self.end_id, None
        return None, (self.start_id, self.end_id)


REASONING_PARSERS: Registry[ReasoningFormat] = Registry("reasoning_parser")
REASONING_PARSERS.register("qwen3", ReasoningFormat("qwen3"))
REASONING_PARSERS.register("deepseek_r1", ReasoningFormat("deepseek_r1", starts_open=True))


def splitters(parser: str | None, prompt: str) -> Callable[[], ReasoningSplitter] | None:
    """A new splitter per reply to `prompt` under the reasoning parser named `parser` (None: no reasoning)."""
    if parser is None:
        return None
    fmt = REASONING_PARSERS.get(parser)
    prompt_open = fmt.open_in(prompt)
    return lambda: ReasoningSplitter(fmt, prompt_open)


class ReasoningSplitter:
    """One reply's text -> (reasoning, content), whole or as it streams (see the module docstring)."""

    def __init__(self, fmt: ReasoningFormat, prompt_open: bool = False):
        self.fmt = fmt
        self.reasoning = ""
        self.content = ""
        self._state = "reasoning" if prompt_open else "start"  # start | reasoning | content
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        """New (reasoning, content) text from the next piece of the reply."""
        text, self._held = self._held + text, ""
        reasoning = content = ""
        while text:
            if self._state == "start":
                text = self._opening(text)
                if text is None:
                    return reasoning, content
            elif self._state == "reasoning":
                piece, text = self._until_end(text)
                reasoning += piece
            else:
                content += text
                text = ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: held text is what the state says (a half marker is plain text)."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            self.reasoning += held
            return held, ""
        self.content += held
        return "", held

    def parse(self, text: str) -> tuple[str, str]:
        """A whole reply: (reasoning, content)."""
        self.feed(text)
        self.finish()
        return self.reasoning, self.content

    # -- the scan --------------------------------------------------------------------------------
    def _opening(self, text: str) -> str | None:
        """Before the first visible character: a start marker (after blanks) opens the reasoning, anything else
        makes the whole reply content. None: undecided, held."""
        stripped = text.lstrip()
        if not stripped or (self.fmt.start.startswith(stripped) and stripped != self.fmt.start):
            self._held = text
            return None
        if stripped.startswith(self.fmt.start):
            self._state = "reasoning"
            return stripped[len(self.fmt.start):]
        self._state = "content"
        return text

    def _until_end(self, text: str) -> tuple[str, str]:
        """(reasoning, the rest after the end marker); a possible marker prefix at the end is held."""
        end = self.fmt.end
        at = text.find(end)
        if at >= 0:
            self._state = "content"
            return text[:at], text[at + len(end):]
        keep = next((n for n in range(min(len(text), len(end) - 1), 0, -1) if end.startswith(text[-n:])), 0)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep], ""
