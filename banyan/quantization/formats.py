"""Quantized weight formats: how an [out, in] linear weight is stored, and the math back to floats.

    int8  symmetric, one scale per output row:    w[n, k] = s[n] * q[n, k]                    q in [-127, 127]
    int4  asymmetric, per group of g inputs:       w[n, k] = s[n, j] * (q[n, k] - 8) + z[n, j]  j = k // g, q in [0, 15]
    fp8   float8_e4m3fn, one scale per output row: w[n, k] = s[n] * f[n, k]                    |f| <= 448
    fp16  float16 weights for a float32 model:     w[n, k] = h[n, k]                            |h| <= 65504

int4's `(q - 8) * s + z` is the convention of torch's CPU int4 kernel; GGUF's Q4_1 (w = d * q + m
per block of 32) is the same with s = d, z = m + 8d, and Q4_0 (w = d * (q - 8)) with z = 0.

These are also the compact tensors the GGUF loader hands over: `take_rows` reorders them (Q/K
un-permuting), `copy_rows` writes one into a merged layer's rows, `dequantize()` turns it back into floats.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from banyan.registry import Registry

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_MAX = 65504.0  # largest finite float16


@dataclass
class RowScaledWeight:
    """w[n, k] = scale[n] * q[n, k]: symmetric, one scale per output row (int8 and fp8)."""

    q: torch.Tensor  # [out, in], int8 or float8_e4m3fn
    scale: torch.Tensor  # [out]

    limit: ClassVar[float]  # the largest |q|
    storage: ClassVar[torch.dtype]  # q's dtype
    scale_dtype: ClassVar[torch.dtype | None] = None  # None: the model's

    @classmethod
    def empty(cls, out: int, cols: int, scale_dtype: torch.dtype, device=None, group_size: int = 0) -> RowScaledWeight:
        return cls(torch.zeros(out, cols, dtype=cls.storage, device=device),
                   torch.zeros(out, dtype=cls.scale_dtype or scale_dtype, device=device))

    @classmethod
    def quantize(cls, w: torch.Tensor) -> RowScaledWeight:
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / cls.limit
        return cls(cls.encode((w.float() / scale[:, None]).clamp(-cls.limit, cls.limit)), scale)

    @staticmethod
    def encode(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.q.to(dtype) * self.scale[:, None].to(dtype)


class Int8Weight(RowScaledWeight):
    limit = 127.0
    storage = torch.int8

    @staticmethod
    def encode(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x).to(torch.int8)


class Fp8Weight(RowScaledWeight):
    limit = FP8_MAX
    storage = torch.float8_e4m3fn
    scale_dtype = torch.float32

    @staticmethod
    def encode(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn)


@dataclass
class Int4Weight:
    q: torch.Tensor  # uint8 [out, in], one value in [0, 15] per byte (packed once loading is done)
    scale: torch.Tensor  # [out, in // group]
    zero: torch.Tensor  # [out, in // group]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @classmethod
    def empty(cls, out: int, cols: int, scale_dtype: torch.dtype, device=None, group_size: int = 32) -> Int4Weight:
        groups = cols // group_size
        return cls(torch.zeros(out, cols, dtype=torch.uint8, device=device),
                   torch.zeros(out, groups, dtype=scale_dtype, device=device),
                   torch.zeros(out, groups, dtype=scale_dtype, device=device))

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int) -> Int4Weight:
        """Min/max per group: the group's min maps to q = 0, its max to q = 15."""
        out, cols = w.shape
        groups = w.float().reshape(out, cols // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(out, cols), scale, low + 8 * scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, cols = self.q.shape
        groups = self.q.reshape(out, -1, self.group_size).to(dtype) - 8
        return (groups * self.scale[..., None].to(dtype) + self.zero[..., None].to(dtype)).reshape(out, cols)


@dataclass
class Fp16Weight:
    """Half the bytes of float32 and exact to fp16's 11 bits: a bf16 checkpoint loses nothing but
    values under 6e-5 (fp16's subnormals), a GGUF Q4/Q8 one is already coarser."""

    q: torch.Tensor  # [out, in], float16

    @classmethod
    def empty(cls, out: int, cols: int, scale_dtype: torch.dtype, device=None, group_size: int = 0) -> Fp16Weight:
        return cls(torch.zeros(out, cols, dtype=torch.float16, device=device))

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp16Weight:
        return cls(w.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.q.to(dtype)


QuantizedWeight = Int8Weight | Int4Weight | Fp8Weight | Fp16Weight
WEIGHT_KINDS: Registry[type] = Registry("quantization")  # a WeightFormat's kind -> the class holding its tensors
for _kind, _weight in (("int8", Int8Weight), ("int4", Int4Weight), ("fp8", Fp8Weight), ("fp16", Fp16Weight)):
    WEIGHT_KINDS.register(_kind, _weight)


@dataclass(frozen=True)
class WeightFormat:
    """What one linear layer stores: kind int8, int4 (with its group size), fp8 or fp16."""

    kind: str
    group_size: int = 0  # int4 only

    def empty(self, out: int, cols: int, scale_dtype: torch.dtype, device=None) -> QuantizedWeight:
        """Zeroed storage for an [out, cols] weight, filled row by row while loading."""
        return WEIGHT_KINDS.get(self.kind).empty(out, cols, scale_dtype, device, self.group_size)

    def convert(self, weight: torch.Tensor | QuantizedWeight) -> QuantizedWeight:
        """`weight` in this format: taken as is when it already is, else (de)quantized into it."""
        if self.holds(weight):
            return weight
        if not isinstance(weight, torch.Tensor):
            weight = weight.dequantize()
        if self.kind == "int4":
            return Int4Weight.quantize(weight, self.group_size)
        return WEIGHT_KINDS.get(self.kind).quantize(weight)

    def holds(self, weight: torch.Tensor | QuantizedWeight) -> bool:
        if not isinstance(weight, WEIGHT_KINDS.get(self.kind)):
            return False
        return self.kind != "int4" or weight.group_size == self.group_size


INT8 = WeightFormat("int8")
FP8 = WeightFormat("fp8")
FP16 = WeightFormat("fp16")


def shape_of(weight: QuantizedWeight | torch.Tensor) -> tuple[int, ...]:
    return tuple(weight.shape if isinstance(weight, torch.Tensor) else weight.q.shape)


def take_rows(weight: QuantizedWeight, rows: torch.Tensor | slice) -> QuantizedWeight:
    """The same weight restricted to (or reordered by) output rows: every field is per row."""
    return type(weight)(*(getattr(weight, f.name)[rows] for f in fields(weight)))


def take_columns(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """The same weight restricted to inputs [start, stop) (a row-parallel shard): q's columns, and for int4 the
    groups they make up, so the bounds must fall on group boundaries (ValueError otherwise); per-row scales stay.

        q:      [ ... | start ... stop | ... ]     one column per input
        scale:  [ ... | start/g .. stop/g | ... ]  int4: one column per group of g inputs; int8: [out], kept
    """
    cols = shape_of(weight)[1]
    parts = []
    for f in fields(weight):
        t = getattr(weight, f.name)
        if t.dim() == 2:
            step = cols // t.shape[1]
            if start % step or stop % step:
                raise ValueError(f"inputs [{start}, {stop}) do not fall on {step}-input groups")
            t = t[:, start // step : stop // step]
        parts.append(t)
    return type(weight)(*parts)


def pad_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """Zero rows appended up to `rows` (they dequantize to 0): the last shard of a vocabulary split."""
    missing = rows - shape_of(weight)[0]
    if missing <= 0:
        return weight
    return type(weight)(*(torch.cat([t, t.new_zeros((missing, *t.shape[1:]))]) for t in
                          (getattr(weight, f.name) for f in fields(weight))))


def copy_rows(dest: QuantizedWeight, rows: slice, src: QuantizedWeight) -> None:
    for f in fields(dest):
        getattr(dest, f.name)[rows].copy_(getattr(src, f.name))

