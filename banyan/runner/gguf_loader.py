"""Reading GGUF tensors (llama.cpp's format) as Hugging Face tensors.

    reader = gguf_metadata.open_reader(path)  # checkpoint/gguf_metadata.py: checks, metadata, shape
    iter_tensors(reader, arch) -> ("model.layers.0.self_attn.q_proj.weight", fp32 tensor), ...

Tensors are dequantized to fp32 (or, with compact=True, Q4_0/Q4_1/Q8_0 kept as banyan's quantized
weights) and renamed to their Hugging Face names; llama's Q/K rows are un-permuted back to
Hugging Face's RoPE layout. The tokenizer is built in checkpoint/gguf_tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from banyan.checkpoint.gguf_metadata import hf_name
from banyan.config import ModelArch
from banyan.errors import ModelLoadError
from banyan.quantization.formats import INT8, Int4Weight, Int8Weight, QuantizedWeight, WeightFormat, shape_of, take_rows


def iter_tensors(reader, arch: ModelArch, compact: bool = False,
                 shard=None) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) for every tensor: fp32, or with compact=True the ones compact_formats
    names as banyan's quantized weights (Q4_0/Q4_1 -> Int4Weight, Q8_0 -> Int8Weight).
    shard(name) -> WeightShard | None (tensor parallel): a float tensor's rows are sliced before dequantizing
    (only they are read), columns after; a compact one is sliced whole (rows, or inputs by whole groups)."""
    rope_permuted = arch.architecture == "LlamaForCausalLM"  # llama.cpp permutes Q/K for llama only
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        part = shard(name) if shard is not None else None
        if part is not None and part.skip:
            continue
        kept = compact and _compact_format(t) is not None
        rows_first = part is not None and part.dim == 0 and not part.zero and not kept
        w = _read_compact(t) if kept else _dequantize(t, part.index(1)[0] if rows_first else slice(None))
        if rope_permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            w = _unpermute_rope(w, shape_of(w)[0] // arch.head_dim)  # whole heads, sliced or not
        if part is not None:
            w = part.finish(w) if rows_first else part.take(w)
        yield name, w


def compact_formats(reader) -> dict[str, WeightFormat]:
    """Hugging Face name -> format of each tensor that iter_tensors(compact=True) keeps quantized."""
    formats = {}
    for t in reader.tensors:
        name, fmt = hf_name(t.name), _compact_format(t)
        if name is not None and fmt is not None:
            formats[name] = fmt
    return formats


def _compact_format(t) -> WeightFormat | None:
    if len(t.shape) != 2:
        return None
    return {"Q4_0": WeightFormat("int4", 32), "Q4_1": WeightFormat("int4", 32), "Q8_0": INT8}.get(t.tensor_type.name)


def _dequantize(t, rows: slice = slice(None)) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        w = dequantize(t.data[rows], t.tensor_type)  # [out, in] (ggml dims reversed)
    except NotImplementedError:
        raise ModelLoadError(f"{t.name}: ggml type {t.tensor_type.name} cannot be dequantized") from None
    return torch.from_numpy(np.require(w, np.float32, ["C", "W"]))  # a copy when w views the file


def _read_compact(t) -> QuantizedWeight:
    """Q8_0 is requantized with one scale per row (torch's int8 kernel wants that; Q8_0 has one per
    32 values); Q4_0/Q4_1 blocks become int4 groups of 32 with the same values."""
    if t.tensor_type.name == "Q8_0":
        return Int8Weight.quantize(_dequantize(t))
    return _int4_blocks(t)


def _int4_blocks(t) -> Int4Weight:
    """Q4_0 / Q4_1 blocks of 32 values as Int4Weight, w = s * (q - 8) + z per group:

        Q4_0 block: | d f16 | 16 bytes |           w = d * (q - 8)   ->  s = d, z = 0
        Q4_1 block: | d f16 | m f16 | 16 bytes |   w = d * q + m     ->  s = d, z = m + 8d
        byte i of the 16 holds value i (low nibble) and value i + 16 (high nibble)
    """
    has_min = t.tensor_type.name == "Q4_1"
    raw = torch.from_numpy(np.array(t.data))  # [rows, blocks * block bytes] uint8, copied out of the read-only map
    header = 4 if has_min else 2
    blocks = raw.view(raw.shape[0], -1, header + 16)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # [rows, blocks]
    zero = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float() + 8 * d if has_min else torch.zeros_like(d)
    nibbles = blocks[..., header:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(raw.shape[0], -1)  # [rows, cols]
    return Int4Weight(q, d, zero)


def _unpermute_rope(w: torch.Tensor | QuantizedWeight, n_heads: int) -> torch.Tensor | QuantizedWeight:
    """Undo llama.cpp's RoPE permutation of Q or K rows.

    Per head of d rows, Hugging Face rotates row i with row i + d/2 (rotate_half); llama.cpp
    interleaves them so ggml rotates adjacent rows:
        HF:   [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]
        GGUF: [x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)]
    Exact: the quantization blocks run along each row, so rows move whole (scales with them).
    """
    rows = shape_of(w)[0]
    order = torch.arange(rows).view(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(rows)
    return w[order] if isinstance(w, torch.Tensor) else take_rows(w, order)
