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
safetensors (a pre-quantized checkpoint's packed layers put together by quantization/prequantized.py),
gguf_loader GGUF tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path

import torch

from banyan.checkpoint import PICKLE_SUFFIXES, Checkpoint, gguf_metadata, open_checkpoint, pickle_refused, read_json
from banyan.checkpoint.safetensors_header import check_safetensors
from banyan.distributed.tensor_parallel import WeightShard
from banyan.errors import ModelLoadError
from banyan.quantization.formats import QuantizedWeight, WeightFormat
from banyan.quantization.prequantized import PackedLayers
from banyan.runner import gguf_loader


Shards = Callable[[str], WeightShard | None]  # checkpoint name -> this rank's part (tensor parallel)


class ModelSource(Checkpoint):
    """A Checkpoint whose tensors can be read."""

    def iter_weights(self, compact: bool = False, shard: Shards | None = None,
                     device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(Hugging Face name, tensor) pairs, read lazily; float tensors as stored, GGUF and AWQ/GPTQ/compressed-tensors
        layers dequantized to fp32 (compact=True: the ones compact_formats() names come as banyan's quantized weights).
        shard(name): the part of each tensor this tensor-parallel rank holds (None: all of it); a safetensors
        file is read only there (get_slice), a GGUF tensor's rows likewise (its columns after dequantizing).
        device: a float safetensors directory's tensors are read straight onto it, in their stored dtype (a bf16
        checkpoint never passes through a float32 or a host copy); others come on the CPU."""
        if self.path.is_file():
            return gguf_loader.iter_tensors(self._reader(), self.arch, compact, shard)
        if self.quantization is not None:  # AWQ, GPTQ, compressed-tensors: each layer's packed tensors -> one weight
            layers = PackedLayers(self.quantization, _header_shapes(self.path))
            return layers.assemble(_iter_safetensors(self.path, layers.reading(shard)), compact, shard)
        return _iter_safetensors(self.path, shard, device)

    def compact_formats(self) -> dict[str, WeightFormat] | None:
        """Hugging Face name -> quantized format, for the tensors iter_weights(compact=True) keeps compact;
        None for a float Hugging Face directory."""
        if self.path.is_file():
            return gguf_loader.compact_formats(self._reader())
        if self.quantization is not None:
            return PackedLayers(self.quantization, _header_shapes(self.path)).formats()
        return None

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
            check_safetensors(file)
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


def _header_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape, from the headers alone."""
    shapes = {}
    for file, names in _safetensors_plan(path):
        header = check_safetensors(file)
        listed = [n for n in header if n != "__metadata__" and (names is None or n in names)]
        shapes.update({n: header[n]["shape"] for n in listed})
    return shapes


def _iter_safetensors(path: Path, shard: Shards | None = None,
                      device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file, names in _safetensors_plan(path):
        header = check_safetensors(file)  # again: the file is read now, not when it was opened
        missing = [n for n in names or () if n not in header]
        if missing:
            raise ModelLoadError(f"{file}: the index lists {missing[:3]} here, but the file lacks them")
        try:
            with safe_open(str(file), framework="pt", device=str(device or "cpu")) as f:
                for name in names or [n for n in header if n != "__metadata__"]:
                    part = shard(name) if shard is not None else None
                    if part is not None and part.skip:
                        continue
                    yield name, f.get_tensor(name) if part is None else _read_part(f, name, part)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: {e}") from None


def _read_part(f, name: str, part: WeightShard) -> torch.Tensor:
    """Only this rank's slice of the tensor leaves the file."""
    if part.zero:  # a bias: small
        return part.take(f.get_tensor(name))
    view = f.get_slice(name)
    return part.finish(view[part.index(len(view.get_shape()))])
