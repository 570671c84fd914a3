"""A GGUF file's header and metadata, read without torch: the checks, the reader, the model's shape.

    reader = open_reader(path)               # header walked with bounds checks first
    meta = read_metadata(reader, path)       # plain Python values
    arch = read_arch(reader, meta, path)     # -> ModelArch

gguf.GGUFReader maps the file with numpy (np.memmap) and reads nothing until asked; the API server
opens a GGUF through here for its tokenizer and shape, the runner (runner/gguf_loader.py) for its tensors.
"""

from __future__ import annotations

import functools
import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from banyan.config import ModelArch
from banyan.errors import ModelLoadError, UnsupportedModelError

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_GGUF_SKIPPED = ("rope_freqs.weight",)  # folded into arch.rope_scaling


def open_reader(path: Path):
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


def read_metadata(reader, path: Path) -> dict[str, Any]:
    """The metadata as plain Python values (strings decoded, arrays as lists)."""
    meta = {}
    try:
        for key, fld in reader.fields.items():
            if not key.startswith("GGUF."):
                meta[key] = fld.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise ModelLoadError(f"{path}: malformed GGUF metadata ({e})") from None
    return meta


def read_arch(reader, meta: dict[str, Any], path: Path) -> ModelArch:
    """The model's shape from the metadata and tensor shapes; every tensor must map to a Hugging Face name."""
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        if name not in _GGUF_SKIPPED and hf_name(name) is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has no Hugging Face counterpart banyan knows")
    try:
        return _gguf_arch(meta, tensors, path)
    except (TypeError, ValueError, KeyError) as e:  # e.g. a per-layer array where a number belongs
        raise ModelLoadError(f"{path}: malformed GGUF metadata ({e!r})") from None


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


def hf_name(gguf_name: str) -> str | None:
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
