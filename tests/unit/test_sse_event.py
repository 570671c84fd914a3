"""A server-sent event is one line, whatever the generated text holds (found by the soak: a token decoding to
U+2028 cut an event in two for clients that split lines as str.splitlines does, httpx's aiter_lines among them)."""

from __future__ import annotations

import json

import banyan.server.app  # noqa: F401 - loads the server modules in the order their imports need
from banyan.server.sse import ChunkEncoder, escape_line_breaks, sse_event

ALL_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # str.splitlines' line boundaries


def test_an_event_is_one_line_and_decodes_to_the_same_text():
    text = "".join(f"{c}x" for c in ALL_LINE_BREAKS) + "é中"
    event = sse_event({"choices": [{"text": text}]})
    assert event.endswith("\n\n")
    (line,) = event[:-2].splitlines()
    assert line.startswith("data: ") and json.loads(line[6:]) == {"choices": [{"text": text}]}
    assert "é中" in line  # other text stays as it is (ensure_ascii off)


def test_a_chunk_written_from_its_encoded_head_is_the_whole_chunk_on_one_line():
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1764590000, "model": 'a "quoted" model'}
    choices = [{"index": 0, "delta": {"content": ALL_LINE_BREAKS + "é中"}, "logprobs": None, "finish_reason": None}]
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    encoder = ChunkEncoder(head)
    events = escape_line_breaks(encoder.encode(choices) + encoder.encode([], usage)).decode()
    lines = events.splitlines()
    assert events.endswith("\n\n") and [line for line in lines if line] == lines[::2]  # two events, one line each
    assert [json.loads(line[6:]) for line in lines[::2]] == [head | {"choices": choices},
                                                             head | {"choices": [], "usage": usage}]
