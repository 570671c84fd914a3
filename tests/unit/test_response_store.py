"""The Responses API's store (bounded by entries and age, per API key) and its output items (one reply -> items and
typed events, the same whole or streamed)."""

from __future__ import annotations

from banyan.server.response_render import OutputItems, output_messages
from banyan.server.response_store import ResponseStore
from banyan.text.reasoning import REASONING_PARSERS, ReasoningSplitter
from banyan.tools import HERMES, ToolCallParser


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_is_per_tenant_bounded_in_size_and_age():
    clock = Clock()
    store = ResponseStore(max_entries=2, ttl=10.0, clock=clock)
    store.put("a", "r1", {"id": "r1"}, [])
    assert store.get("a", "r1").body == {"id": "r1"}
    assert store.get("b", "r1") is None  # another key: as if it never existed
    store.put("a", "r2", {}, [])
    store.put("b", "r3", {}, [])
    assert store.get("a", "r1") is None and len(store) == 2  # the oldest went
    clock.now = 10.5
    assert store.get("a", "r2") is None and len(store) == 0  # too old
    ResponseStore(0, 10.0).put("a", "r", {}, [])  # size 0 keeps nothing


REPLY = "<think>plan</think>Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>"


def items_for(pieces: list[str]) -> tuple[list[dict], list[dict]]:
    out = OutputItems(ToolCallParser(HERMES), ReasoningSplitter(REASONING_PARSERS.get("qwen3")))
    events = [e for i, p in enumerate(pieces) for e in out.feed(p, done=i == len(pieces) - 1)]
    return out.items, events


def test_one_reply_becomes_reasoning_message_and_call_items_whole_or_streamed():
    whole, events = items_for([REPLY])
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "plan"}]
    assert whole[1]["content"][0]["text"] == "Sure.\n" and whole[2]["arguments"] == '{"x": 1}'
    assert all(i["status"] == "completed" for i in whole)
    streamed, stream_events = items_for([REPLY[i:i + 3] for i in range(0, len(REPLY), 3)])
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(streamed) == strip(whole)
    kinds = [e["type"] for e in stream_events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    for index in range(3):  # each item's events: added first, done last, none of another item between
        mine = [k for k, e in zip(kinds, stream_events) if e.get("output_index") == index]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done"
    args = "".join(e["delta"] for e in stream_events if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"x": 1}'


def test_output_becomes_the_next_turns_assistant_message():
    whole, _ = items_for([REPLY])
    (message,) = output_messages(whole)
    assert message["content"] == "Sure.\n"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
