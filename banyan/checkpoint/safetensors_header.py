"""A safetensors file's layout checked before any tensor is read, without torch (the API server checks LoRA
adapters with it too): offsets and sizes compared in Python's unbounded integers, so a malformed or hostile
file is a ModelLoadError naming it, never an out-of-bounds read."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from banyan.errors import ModelLoadError

_ST_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_ST_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def check_safetensors(file: Path) -> dict[str, Any]:
    """Validate a safetensors file's layout; return its header. ModelLoadError names the file.

        | u64 n | n bytes of JSON header | data area: tensor i at [begin_i, end_i) |
        0       8                        8 + n                                     file size
    """
    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{file}: not a valid safetensors file: {why}")

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8 or n > _ST_MAX_HEADER:
                raise bad(f"header length {n} exceeds the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{file}: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise bad("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_size = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ST_ITEMSIZE:
            raise bad(f"{name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise bad(f"{name}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
            raise bad(f"{name}: data_offsets {offsets!r} are not two non-negative integers")
        begin, end = offsets
        if not begin <= end <= data_size:
            raise bad(f"{name}: data [{begin}, {end}) lies outside the {data_size}-byte data area")
        if math.prod(shape) * _ST_ITEMSIZE[dtype] != end - begin:
            raise bad(f"{name}: {end - begin} bytes stored, but {dtype} x {shape} needs {math.prod(shape) * _ST_ITEMSIZE[dtype]}")
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise bad(f"tensors {prev} and {name} overlap")
    return header


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64
