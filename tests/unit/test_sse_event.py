"""A server-sent event is one line, whatever the generated text holds (found by the soak: a token decoding to
U+2028 cut an event in two for clients that split lines as str.splitlines does, httpx's aiter_lines among them)."""

from __future__ import annotations

import json

import banyan.server.app  # noqa: F401 - loads the server modules in the order their imports need
from banyan.server.serving import sse_event

ALL_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # str.splitlines' line boundaries


def test_an_event_is_one_line_and_decodes_to_the_same_text():
    text = "".join(f"{c}x" for c in ALL_LINE_BREAKS) + "é中"
    event = sse_event({"choices": [{"text": text}]})
    assert event.endswith("\n\n")
    (line,) = event[:-2].splitlines()
    assert line.startswith("data: ") and json.loads(line[6:]) == {"choices": [{"text": text}]}
    assert "é中" in line  # other text stays as it is (ensure_ascii off)
