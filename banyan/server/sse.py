"""Server-sent events as bytes: `data: <json>\\n\\n`, one line each, whatever the generated text holds.

The streaming answers write every chunk through here: msgspec encodes the JSON (about ten times
json.dumps' speed), and a chunk's fixed head (id, object, created, model) is encoded once per
request, so a token costs the encoding of its `choices` alone:

    data: {"id":"chatcmpl-..","object":"chat.completion.chunk","created":1764590000,"model":"m","choices":[...]}
          \\____________________________ ChunkEncoder.prefix, once ___________________________/ \\_ per chunk _/
"""

from __future__ import annotations

import msgspec

RAW_LINE_BREAKS = {"\x85".encode(): b"\\u0085", "\u2028".encode(): b"\\u2028", "\u2029".encode(): b"\\u2029"}
"""Characters JSON leaves raw that str.splitlines (and so httpx's aiter_lines, and SSE clients built on either)
takes for line ends, as UTF-8 -> their JSON escape: escaped, an event stays one line (the soak found a token
decoding to one cut an event). In UTF-8 these byte runs are these characters and nothing else."""

_encode = msgspec.json.Encoder().encode


def escape_line_breaks(data: bytes) -> bytes:
    """`data` (UTF-8 JSON, or several events) with RAW_LINE_BREAKS escaped; the same object when it holds none."""
    for raw, escaped in RAW_LINE_BREAKS.items():
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse_event(payload: dict) -> str:
    """One server-sent event: `data: <json>` on one line."""
    return f"data: {escape_line_breaks(_encode(payload)).decode()}\n\n"


class ChunkEncoder:
    """The chunks of one streamed answer: `head` (its fields before `choices`) encoded once."""

    def __init__(self, head: dict):
        self.prefix = b"data: " + _encode(head)[:-1] + b',"choices":'

    def encode(self, choices: list[dict], usage: dict | None = None) -> bytes:
        """One event, `{**head, "choices": choices}` (+ `"usage"`), line breaks not yet escaped (escape_line_breaks:
        once over a whole write)."""
        tail = b"}\n\n" if usage is None else b',"usage":' + _encode(usage) + b"}\n\n"
        return self.prefix + _encode(choices) + tail
