"""Bindings of cpu_decode_layers.c: every decoder layer of a step of a few rows in one C call.

The C structs are mirrored here field for field (ctypes). Each `Layer` is filled once from the model's
tensors, which must outlive it (the model holds them); `DecodeLayers` runs one step. Which models and steps it
serves is banyan/runner/cpu_step.py's business.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from banyan.kernels import cpu_decode

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
KINDS = {"int4": 0, "int8": 1, "fp16": 2}  # cpu_decode_layers.c's LINEAR_*


class Linear(ctypes.Structure):
    _fields_ = [("kind", _i), ("out", _i), ("in_", _i), ("group", _i), ("half", _i), ("q", _p), ("scale", _p),
                ("offset", _p), ("bias", _p)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("k_cache", _p), ("v_cache", _p), ("window", _i)]


class Step(ctypes.Structure):
    _fields_ = [(name, _i) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "page_size",
                                        "max_pos", "threads", "kv_kind")] + [
        ("eps", _f), ("scale", _f), ("kv_scale", _f), ("kv_inv_scale", _f), ("cos", _p), ("sin", _p), ("positions", _p),
        ("slots", _p), ("tables", _p), ("rows", _p), ("seq_of_row", _p), ("row_positions", _p), ("shared", _p),
        ("table_stride", _i), ("max_keys", _i), ("quant_scratch", _p), ("attn_scratch", _p), ("bf16_tiles", _i)]


class LinearOperands(NamedTuple):
    """A weight as its narrow kernel reads it (QuantizedLinear.narrow_operands), its shape and its bias."""

    kind: str  # a key of KINDS
    weight: torch.Tensor  # int4 | int8 interleaved (cpu_gemv.InterleavedInt4/8.packed) | float16 [N, K]
    scale: torch.Tensor | None
    offset: torch.Tensor | None
    group_size: int
    bias: torch.Tensor | None
    out_features: int
    in_features: int


def linear(op: LinearOperands) -> Linear:
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    half = op.kind == "int4" and op.scale.dtype == torch.float16  # int4's scales and offsets (InterleavedInt4.half)
    return Linear(KINDS[op.kind], op.out_features, op.in_features, op.group_size, int(half), op.weight.data_ptr(),
                  ptr(op.scale), ptr(op.offset), ptr(op.bias))


class DecodeLayers:
    """The library's decode_layers, bound."""

    def __init__(self, lib: ctypes.CDLL):
        lib.decode_layers.argtypes = [_p, _i, _p, _p, _i, _p]
        lib.decode_layers.restype = ctypes.c_int
        self._lib = lib

    def __call__(self, layers: ctypes.Array, num_layers: int, step: Step, x: torch.Tensor, work: torch.Tensor) -> None:
        """x [M, hidden] float32 contiguous, the embeddings, becomes the residual stream after num_layers layers;
        work: scratch of at least M * (2 hidden + qkv + heads * head_dim + 3 intermediate) floats."""
        bad = self._lib.decode_layers(layers, num_layers, ctypes.byref(step), x.data_ptr(), x.shape[0], work.data_ptr())
        if bad:
            raise ValueError(f"{bad} positions outside the rotary table's [0, {step.max_pos})")


def load() -> DecodeLayers | None:
    """The binding where the fused kernels serve (AVX2, a compiler, BANYAN_DISABLE_FUSED_DECODE unset), else None."""
    kernels = cpu_decode.kernels_for(torch.device("cpu"), torch.float32)
    return None if kernels is None else DecodeLayers(kernels._lib)
