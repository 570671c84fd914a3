"""The Responses API's answer: one reply -> output items (reasoning, message, function calls), streamed as typed
events or returned whole; both paths run the same OutputItems, so they cannot disagree.

A reply's text goes through the reasoning splitter (--reasoning-parser), then the tool-call parser; each kind of
piece writes to its own item, opened when its first piece comes and done before the next one opens:

    response.output_item.added         item (status in_progress)
      response.content_part.added      message: an output_text part; reasoning: a reasoning_text part
      response.output_text.delta       ... response.reasoning_text.delta / response.function_call_arguments.delta
      response.output_text.done        ... response.reasoning_text.done / response.function_call_arguments.done
      response.content_part.done
    response.output_item.done          item (status completed)

around them response.created and response.in_progress first, response.completed (or response.incomplete when
max_output_tokens cut it) last, every event numbered by sequence_number. Text that is only whitespace opens no
message (the gaps between tool calls).
"""

from __future__ import annotations

import copy
import uuid

from banyan.text.reasoning import ReasoningSplitter
from banyan.tools import ToolCallParser


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self, parser: ToolCallParser | None, splitter: ReasoningSplitter | None):
        self.parser = parser
        self.splitter = splitter
        self.items: list[dict] = []
        self._open: dict | None = None
        self._blank = ""  # whitespace-only text, held until text that is not follows

    def feed(self, text: str, done: bool = False) -> list[dict]:
        """The events for the next piece of the reply (done: the last; every item closes)."""
        events: list[dict] = []
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        if done and self.splitter:
            more = self.splitter.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        if reasoning:
            events += self._reasoning(reasoning)
        pieces = []
        if self.parser is not None:
            content, pieces = self.parser.feed(content)
            if done:
                content += self.parser.finish()[0]
        if content:
            events += self._text(content)
        for piece in pieces:
            events += self._call(piece)
        if done:
            events += self._close()
        return events

    def mark_incomplete(self) -> None:
        """The reply was cut (max_output_tokens): its last item is incomplete."""
        if self.items:
            self.items[-1]["status"] = "incomplete"

    # -- the items -------------------------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self._kind() != "reasoning":
            events += self._start({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                                   "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self._open["_text"] += text
        return events + [self._delta("response.reasoning_text.delta", text, content_index=0)]

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._kind() != "message":
            if not (self._blank + text).strip():
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
            events += self._start({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                   "role": "assistant", "content": []},
                                  {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self._open["_text"] += text
        return events + [self._delta("response.output_text.delta", text, content_index=0, logprobs=[])]

    def _call(self, piece) -> list[dict]:
        events = []
        if piece.id is not None:  # a new call: its id and name first
            events += self._start({"type": "function_call", "id": new_id("fc"), "call_id": piece.id,
                                   "name": piece.name, "arguments": "", "status": "in_progress"})
        if piece.arguments:
            self._open["_text"] += piece.arguments
            events.append(self._delta("response.function_call_arguments.delta", piece.arguments))
        return events

    def _kind(self) -> str | None:
        return self._open["type"] if self._open else None

    def _start(self, item: dict, part: dict | None = None) -> list[dict]:
        events = self._close()
        self._open = dict(item, _text="", _part=part)
        self.items.append(self._open)
        index = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": index, "item": self._public(item)})
        if part is not None:
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(part)})
        return events

    def _delta(self, kind: str, delta: str, **fields) -> dict:
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, "delta": delta,
                **fields}

    def _close(self) -> list[dict]:
        """The open item's done events; the item takes its final shape in `items`."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, text, part = len(self.items) - 1, item.pop("_text"), item.pop("_part")
        head = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append({"type": "response.function_call_arguments.done", **head, "arguments": text,
                           "name": item["name"]})
        else:
            part = dict(part, text=text)
            item["content"] = [part]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append({"type": done, **head, "content_index": 0, "text": text, **extra})
            events.append({"type": "response.content_part.done", **head, "content_index": 0, "part": dict(part)})
        item["status"] = "completed"
        events.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return events

    @staticmethod
    def _public(item: dict) -> dict:
        return {k: v for k, v in item.items() if not k.startswith("_")}


def output_messages(items: list[dict]) -> list[dict]:
    """The output as chat messages, for a follow-up's conversation (reasoning is not replayed)."""
    text = "".join(p["text"] for item in items if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
