"""Reading tool calls back out of a reply, whole or as it streams.

    parser = ToolCallParser(fmt)
    content, deltas = parser.feed(text_delta)      # per streamed piece of text
    content, deltas = parser.finish()              # at the end: text held back is released
    parser.calls                                   # the calls, with their ids

Text before the tool section is content. In the section, each call object
`{"name": "f", "<arguments_key>": ARGS}` yields a delta with the call's id and name as soon as the name
is read, then the characters of ARGS as they arrive, at most one delta per call for each piece fed
(OpenAI's streaming shape), so joining a call's argument deltas gives the JSON text the model wrote.
Because the reply was generated under the tool grammar (grammar.py), the scan needs no backtracking:
it tracks only JSON nesting and strings. A call the reply ends inside (cut by max_tokens or a stop
string) keeps `complete` False, and `all_complete` is then False too. Content that could be the
start of the trigger (e.g. "<tool_") is held back until it is not.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from enum import Enum

from banyan.tools.formats import PYTHON_TAG, ToolCallFormat

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of one call for a stream: `id` and `name` come once, in its first delta; `arguments` is
    a fragment (the first delta's may be one too)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    """The arguments as the model wrote them (JSON text)."""
    complete: bool = False


class _State(Enum):
    TEXT = "text"  # content, watching for the trigger
    START = "start"  # no trigger format: before the first non-blank character
    SECTION = "section"  # in the tool section, between calls
    HEADER = "header"  # in a call object, before its arguments
    ARGUMENTS = "arguments"  # in the arguments value
    CALL_END = "call_end"  # after the arguments, before the call's closing brace
    PLAIN = "plain"  # no trigger format, and the reply did not open with a call: all content


@dataclass
class _Scan:
    """Where the scan is inside a JSON value."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False


class ToolCallParser:
    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self.content = ""
        self._state = _State.TEXT if fmt.trigger is not None else _State.START
        self._held = ""  # text not yet decided: a possible trigger prefix, or a call header so far
        self._value = _Scan()

    @property
    def in_tool_section(self) -> bool:
        return self._state not in (_State.TEXT, _State.START, _State.PLAIN)

    @property
    def all_complete(self) -> bool:
        """The reply holds calls and none was cut short."""
        return bool(self.calls) and all(c.complete for c in self.calls)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New content text and call deltas from the next piece of the reply."""
        content, deltas = "", []
        for ch in text:
            content += self._step(ch, deltas)
        self.content += content
        return content, _merge(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the reply: content held back as a possible trigger is content after all."""
        rest = ""
        if self._state in (_State.TEXT, _State.START, _State.PLAIN):
            rest, self._held = self._held, ""
        self.content += rest
        return rest, []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply: (content, calls); a call cut short by max_tokens has complete=False."""
        self.feed(text)
        self.finish()
        return self.content, self.calls

    # -- the scan, one character at a time --------------------------------------------------------
    def _step(self, ch: str, deltas: list[ToolCallDelta]) -> str:
        state = self._state
        if state is _State.TEXT:
            return self._text(ch)
        if state is _State.START:
            return self._start(ch)
        if state is _State.PLAIN:
            return ch
        if state is _State.SECTION:
            if ch == "{":
                self._state, self._held = _State.HEADER, ch
        elif state is _State.HEADER:
            self._header(ch, deltas)
        elif state is _State.ARGUMENTS:
            self._arguments(ch, deltas)
        elif state is _State.CALL_END and ch == "}":
            self.calls[-1].complete = True
            self._state = _State.SECTION
        return ""

    def _text(self, ch: str) -> str:
        trigger = self.fmt.trigger
        held = self._held + ch
        if held.endswith(trigger):
            self._held, self._state = "", _State.SECTION
            return held[: -len(trigger)]
        keep = next((n for n in range(min(len(held), len(trigger) - 1), 0, -1) if trigger.startswith(held[-n:])), 0)
        self._held = held[len(held) - keep:]
        return held[: len(held) - keep]

    def _start(self, ch: str) -> str:
        """A format without a trigger: the reply is a tool section when it opens with "{" (or the tag)."""
        held = self._held + ch
        opening = held.lstrip()
        if not opening or PYTHON_TAG.startswith(opening):
            self._held = held
            return ""
        self._held = ""
        if opening.startswith(PYTHON_TAG):
            opening = opening[len(PYTHON_TAG):].lstrip()
        if opening == "" or opening.startswith("{"):
            self._state = _State.SECTION
            for c in opening:
                self._step(c, [])
            return ""
        self._state = _State.PLAIN
        return held

    def _header(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        match = None if ch.isspace() else _HEADER.fullmatch(self._held)
        if match is None:  # the arguments value has not started yet
            self._held += ch
            return
        call = ToolCall(new_call_id(), match.group(1))
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, call.name))
        self._held, self._state, self._value = "", _State.ARGUMENTS, _Scan()
        self._arguments(ch, deltas)

    def _arguments(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        scan = self._value
        if scan.in_string:
            scan.in_string = scan.escaped or ch != '"'
            scan.escaped = not scan.escaped and ch == "\\"
        elif ch == '"':
            scan.in_string = True
        elif ch in "{[":
            scan.depth += 1
        elif ch in "}]":
            scan.depth -= 1
        call = self.calls[-1]
        call.arguments += ch
        deltas.append(ToolCallDelta(len(self.calls) - 1, ch))
        if scan.depth == 0 and not scan.in_string:
            self._state = _State.CALL_END


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call, as OpenAI streams them: a call's argument fragments join the delta before
    them, its first delta (id and name) included."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and d.id is None and merged[-1].index == d.index:
            merged[-1].arguments += d.arguments
        else:
            merged.append(d)
    return merged
