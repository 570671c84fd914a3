"""Reading a checkpoint's tensors: Hugging Face safetensors directories and GGUF files.

    open_model("smollm2-135m-instruct" | "/path/to/hf_dir" | "/path/to/model.gguf") -> ModelSource
    source.arch, source.tokenizer, source.generation_config      # banyan.checkpoint, torch-free
    source.iter_weights() -> ("model.layers.0.self_attn.q_proj.weight", tensor), ... one at a time

Tensors come out under Hugging Face names whatever the file; the model fuses q/k/v and gate/up
itself. Every file is checked before any tensor data is read, with offsets and sizes compared in
Python's unbounded integers (no 64-bit wrap-around), so a malformed or hostile file is a
ModelLoadError, never an out-of-bounds read. Pickle checkpoints are refused, and no code from a
model directory is ever imported.

banyan.checkpoint finds the model and reads its shape and tokenizer; this module reads Hugging Face
safetensors, gguf_loader GGUF tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from banyan.checkpoint import PICKLE_SUFFIXES, Checkpoint, gguf_metadata, open_checkpoint, pickle_refused, read_json
from banyan.errors import ModelLoadError
from banyan.quantization.formats import QuantizedWeight, WeightFormat
from banyan.runner import gguf_loader


class ModelSource(Checkpoint):
    """A Checkpoint whose tensors can be read."""

    def iter_weights(self, compact: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(Hugging Face name, tensor) pairs, read lazily; float tensors as stored, GGUF dequantized to fp32
        (compact=True: the GGUF tensors named by compact_formats() come as banyan's quantized weights)."""
        if self.path.is_file():
            return gguf_loader.iter_tensors(self._reader(), self.arch, compact)
        return _iter_safetensors(self.path)

    def compact_formats(self) -> dict[str, WeightFormat] | None:
        """Hugging Face name -> quantized format, for the tensors iter_weights(compact=True) keeps compact;
        None for a Hugging Face directory (its tensors are floats)."""
        return gguf_loader.compact_formats(self._reader()) if self.path.is_file() else None

    def _reader(self):
        if self._gguf is None:
            self._gguf = gguf_metadata.open_reader(self.path)
        return self._gguf


def open_model(model: str, trust_remote_code: bool = False, tokenizer: str | None = None) -> ModelSource:
    """open_checkpoint (shape, tokenizer, generation config), with every safetensors file checked.

    tokenizer: a Hugging Face directory (or .gguf file) whose tokenizer and chat template replace the model's."""
    checkpoint = open_checkpoint(model, trust_remote_code, tokenizer)
    if checkpoint.path.is_dir():
        for file, _ in _safetensors_plan(checkpoint.path):
            _check_safetensors(file)
    return ModelSource(**{f.name: getattr(checkpoint, f.name) for f in fields(Checkpoint)})


# -- Hugging Face directories ------------------------------------------------------------------


def _safetensors_plan(path: Path) -> list[tuple[Path, list[str] | None]]:
    """[(file, tensor names to read from it, or None for all)], from the index when sharded."""
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no weight_map")
        plan: dict[str, list[str]] = {}
        for name, filename in weight_map.items():
            if not isinstance(filename, str) or Path(filename).name != filename or not filename.endswith(".safetensors"):
                raise ModelLoadError(f"{index_path}: {name!r} maps to {filename!r}, not a .safetensors file in {path}")
            plan.setdefault(filename, []).append(name)
        return [(path / filename, names) for filename, names in plan.items()]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return [(file, None) for file in files]
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_refused(pickles[0])
    raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file, names in _safetensors_plan(path):
        header = _check_safetensors(file)  # again: the file is read now, not when it was opened
        missing = [n for n in names or () if n not in header]
        if missing:
            raise ModelLoadError(f"{file}: the index lists {missing[:3]} here, but the file lacks them")
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in names or [n for n in header if n != "__metadata__"]:
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: {e}") from None


_ST_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_ST_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def _check_safetensors(file: Path) -> dict[str, Any]:
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
