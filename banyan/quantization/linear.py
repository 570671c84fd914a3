"""QuantizedLinear: a linear layer whose weight is stored quantized, and the kernels that multiply by it.

Loading fills the weight row range by row range (the shards of a merged q/k/v or gate/up layer,
each quantized as it arrives: every format's scales are per row, so this equals quantizing the
merged matrix). `finish_loading()` then picks the kernel and lays the weight out for it:

    int8  torch._weight_int8pack_mm (CPU)       | dequantize, matmul, scale the output columns
    int4  torch._weight_int4pack_mm_for_cpu     | unpack two values a byte, dequantize, matmul
    fp8   torch._scaled_mm, per-token fp8 input  | dequantize, matmul
    fp16  FBGEMM's fp16 GEMM, fp32 in and out    | dequantize, matmul

The packed integer kernels are taken on CPUs with AVX-512 only: with AVX2 alone PyTorch 2.13 runs
them as scalar loops, 10-40x slower than a float32 matmul (measured on an AVX2 EPYC). There, int8 and
int4 layers multiply with banyan's own AVX2 kernel (banyan/kernels/cpu_gemv.c: integer dot products against x
quantized to int8 per block of 32, as llama.cpp does; 1.2-4x faster than dequantizing at 16-256 rows). int4 layers
take it for every row count (its 8-row interleaved layout is 1.4-1.85x faster than FBGEMM's fp16 GEMM from 8 rows
to 256 on an AVX2 EPYC); int8 layers every row, or with `wide_fp16` up to 8 rows (decode) and wider batches
through a float16 copy (FBGEMM's GEMM, faster than the int8 kernel there on AVX2). torch._scaled_mm runs on CPU and on CUDA from sm89 (Ada,
Hopper) for dimensions that are multiples of 16; elsewhere fp8 is dequantized. FBGEMM's fp16 GEMM
(`quantized::linear_dynamic_fp16`, in every x86 build of torch) reads half the bytes of a float32
matmul and converts in registers (F16C): decode, which streams every weight once per step, is
memory bound, so it runs up to 2x faster there, and no slower at prefill sizes.

On CPUs with AMX tiles, outside batch-invariant mode, int8/int4 layers keep a bf16 copy (`wide_bf16`) for calls of
BF16_ROWS rows and more (prefill): torch's bf16 GEMM runs on the tiles at 1.0-1.9 TFLOP/s on 2 cores from 256 rows,
where banyan's integer kernel, whose every block of 32 inputs leaves the tiles for its float scaling, stays near
1 TOP/s (docs/quantization.md, "CPUs with AMX"). The copy is kept in oneDNN's blocked layout (`onednn_blocked`).

None of torch's GEMMs gives a row the same bits whatever the row count (measured over 1-64 rows: MKL's
float32 and FBGEMM's fp16 both move in the last bits), and the switch at 8 rows changes x's rounding. With
`batch_invariant` every row goes through banyan's kernel instead (int8/int4, and fp16 through its float
kernel; float32 layers become `FixedOrderLinear`): each row's result is independent of the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from banyan.errors import ModelLoadError
from banyan.kernels import cpu_gemv
from banyan.quantization.formats import FP8_MAX, Int8Weight, QuantizedWeight, WeightFormat, copy_rows, shape_of, take_rows
from banyan.quantization.packing import InputOrdered, common_input_order

_CPU_CHUNK_VALUES = 1 << 19  # weights dequantized at a time on a CPU: 2 MiB of float32
BF16_ROWS = 128
"""Rows of x from which an AMX CPU's bf16 copy serves (`wide_bf16`): at 64 rows the integer kernel was as fast
(0.94 against 0.78 TFLOP/s, 1536 x 576 int4), from 256 the bf16 GEMM 1.3-1.9x it."""


def onednn_blocked(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in oneDNN's own blocked layout, where torch's build has oneDNN: `F.linear` on the plain
    tensor re-blocks the weight for the tiles in every call, which at prefill sizes is a third of the GEMM (1.2-1.6x
    faster from 128 to 333 rows, level from 512, the same bits: docs/quantization.md). Else the plain tensor."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except (AttributeError, RuntimeError):  # a build without oneDNN, or one that refuses the shape
        return weight


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times a bf16 weight [N, K] as `onednn_blocked` left it: y = x W^T, bf16."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def packed_int_kernels_fast(device: torch.device) -> bool:
    """Whether torch's packed int8/int4 kernels take int layers here: vectorized on a CPU with AVX-512, but only
    where banyan's kernel cannot be built (on a Zen 4 EPYC with AVX-512 VNNI banyan's was ~20x faster at
    batch 1: docs/quantization.md, "CPUs with AVX-512")."""
    return (device.type == "cpu" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            and cpu_gemv.load() is None)


def fbgemm_fp16_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FBGEMM's fp16-weight GEMM serves a model computing in `dtype` here (x86 CPU, float32)."""
    return device.type == "cpu" and dtype == torch.float32 and "fbgemm" in torch.backends.quantized.supported_engines


def scaled_mm_works(device: torch.device, out_features: int, in_features: int) -> bool:
    if out_features % 16 or in_features % 16:
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored in `fmt`; out_sizes names merged shards, as in MergedLinear."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, bias: bool = False,
                 out_sizes: dict[str, int] | None = None, packed_kernels: bool | None = None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.out_sizes = dict(out_sizes) if out_sizes else None
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.dtype = torch.get_default_dtype()  # the compute dtype the model is built in
        self.packed_kernels = packed_kernels  # None: decided from the machine in finish_loading
        self.keep_rows = False  # True when tied embeddings read the weight's rows
        self.wide_fp16 = False  # set before finish_loading: keep a float16 copy for wide batches (CPU)
        self.batch_invariant = False  # set before finish_loading: every row through the CPU kernel (row-independent)
        self.cpu_kernel = True  # set before finish_loading: False leaves banyan's CPU kernel out (the torch paths)
        self.wide = None  # that copy, FBGEMM-packed
        self.wide_bf16 = False  # set before finish_loading: keep a bf16 copy for calls of BF16_ROWS rows and more (AMX)
        self.bf16 = None  # that copy
        self.gemv = self._narrow = None  # banyan's CPU kernel for a few rows (int8/int4 on AVX2), when it serves
        self.weight = fmt.empty(out_features, in_features, self.dtype, device=torch.get_default_device())
        self.device = self.weight.q.device
        self.packed = self.scale_zeros = self.offset = None  # int4 and fp16, set by finish_loading
        self.interleaved = None  # int4/int8 in the CPU kernel's layout (cpu_gemv.InterleavedInt4/8), where it serves
        self.packed_bytes = 0  # of an FBGEMM-packed weight (an opaque object, not a tensor)
        self._matmul = None  # set by finish_loading
        self.input_order = None  # GPTQ act-order: the weight's inputs are stored permuted, x[:, input_order] meets them
        self._shard_orders = []  # each loaded shard's input order (None: the inputs' own)

    @classmethod
    def like(cls, linear: nn.Linear, fmt: WeightFormat) -> QuantizedLinear:
        """An empty QuantizedLinear with `linear`'s shape, bias and shards, built where it lives."""
        with torch.device(linear.weight.device):
            return cls(linear.in_features, linear.out_features, fmt, linear.bias is not None,
                       getattr(linear, "out_sizes", None))

    def load_weight(self, rows: slice, weight: torch.Tensor | QuantizedWeight | InputOrdered, name: str) -> None:
        self._shard_orders.append(weight.order.to(self.device) if isinstance(weight, InputOrdered) else None)
        self.input_order = common_input_order(self._shard_orders, name)  # q/k/v, gate/up: one input, one order
        weight = weight.weight if isinstance(weight, InputOrdered) else weight
        expected = (len(range(self.out_features)[rows]), self.in_features)
        if shape_of(weight) != expected:
            raise ModelLoadError(f"{name}: checkpoint shape {shape_of(weight)}, model expects {expected}")
        if isinstance(weight, torch.Tensor):
            weight = weight.to(self.weight.q.device)  # quantize where the model lives (fast on a GPU)
        copy_rows(self.weight, rows, self.fmt.convert(weight))

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Lay the loaded weight out for its kernel; the layer is read-only from here on."""
        device, kind, invariant = self.device, self.fmt.kind, self.batch_invariant
        if self.packed_kernels is None:
            self.packed_kernels = packed_int_kernels_fast(device) and not invariant
        gemv = None
        wanted = kind in ("int8", "int4") and not self.packed_kernels or kind == "fp16" and invariant
        if wanted and self.cpu_kernel and cpu_gemv.supported(device, self.dtype, self.in_features):
            gemv = cpu_gemv.load()
        # the kernel takes every row count: int4's and VNNI's int8 beat FBGEMM's fp16 GEMM at every width (int8 2-2.6x
        # from 16 rows on a Zen 4); AVX2's int8 measured about level with it, so wide batches keep the fp16 copy there
        every_row = gemv is not None and (invariant or kind == "int4" or kind == "int8" and gemv.vnni)
        if self.wide_fp16 and kind != "fp16" and fbgemm_fp16_works(device, self.dtype) and not every_row:
            self.wide = torch.ops.quantized.linear_prepack_fp16(self.weight.dequantize(torch.float32), None)
            self.packed_bytes = self.in_features * self.out_features * 2
        if self.wide_bf16 and gemv is not None and not invariant:  # in place of banyan's kernel for prefill
            self.bf16 = onednn_blocked(self.weight.dequantize(torch.float32).to(torch.bfloat16))
        if kind == "int8":
            self._finish_int8(gemv)
        elif kind == "int4":
            self._finish_int4(gemv)
        elif kind == "fp16":
            self._finish_fp16(device)
        else:
            fast = scaled_mm_works(device, self.out_features, self.in_features)
            self._matmul = self._fp8_scaled_mm if fast else self._fp8_dequant
        if gemv is not None:
            self.gemv, self._narrow = gemv, {"int8": self._int8_gemv, "int4": self._int4_gemv, "fp16": self._fp16_gemv}[kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            x2 = x2.index_select(1, self.input_order)
        if self.bf16 is not None and x2.shape[0] >= BF16_ROWS:
            y = bf16_linear(x2.to(torch.bfloat16), self.bf16).to(x2.dtype)
        elif self.gemv is not None and (self.wide is None or x2.shape[0] <= self.gemv.max_rows):  # a float16 copy: wide
            y = self._narrow(x2.contiguous())
        elif self.wide is not None:
            y = torch.ops.quantized.linear_dynamic_fp16(x2.contiguous(), self.wide)
        else:
            y = self._matmul(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def serves_bf16(self, rows: int) -> bool:
        """Whether a call of `rows` rows takes the bf16 copy (AMX prefill), which then takes bf16 x as it is and
        returns bf16 (the output follows x's dtype)."""
        return self.bf16 is not None and rows >= BF16_ROWS and self.input_order is None

    def narrow_operands(self) -> tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """(kind, weight, scale, offset) as the narrow kernel reads them, where it serves up to max_rows rows of x
        and the inputs keep their order (callers running the kernel themselves, banyan/runner/cpu_step.py); else
        None. int4: packed blocks, scale and offset per group; int8: values and row scales; fp16: the values."""
        if self.gemv is None or self.input_order is not None:
            return None
        kind, w = self.fmt.kind, self.weight
        if kind == "int4":
            return kind, self.interleaved.packed, self.interleaved.scale, self.interleaved.offset
        if kind == "int8":
            return kind, self.interleaved.packed, self.interleaved.scale, None
        return kind, w.q, None, None

    def weight_rows(self, ids: torch.Tensor) -> QuantizedWeight:
        """Rows `ids` of the weight (tied embeddings read lm_head's), from the layout its kernel keeps."""
        if isinstance(self.interleaved, cpu_gemv.InterleavedInt8):
            return Int8Weight(*self.interleaved.rows(ids))
        return take_rows(self.weight, ids)

    def quantized_bytes(self) -> int:
        held = [self.packed, self.scale_zeros, self.offset, self.bf16,
                *(vars(self.weight).values() if self.weight is not None else ())]
        interleaved = self.interleaved.nbytes() if self.interleaved is not None else 0
        return self.packed_bytes + interleaved + sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"

    # -- int8 ---------------------------------------------------------------------------------
    def _int8_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.contiguous(), self.weight.q, self.weight.scale)

    def _finish_int8(self, gemv: cpu_gemv.CpuKernels | None) -> None:
        self._matmul = self._int8_packed if self.packed_kernels else self._int8_dequant
        if gemv is not None:  # the kernel's layout (8 rows interleaved, see cpu_gemv.c) is the only copy kept
            self.interleaved = cpu_gemv.interleave_int8(self.weight.q, self.weight.scale)
            self.weight.q = self.weight.scale = None
            self._matmul = self._int8_gemv

    def _int8_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv.int8(x, self.interleaved)

    def _int8_dequant(self, x: torch.Tensor) -> torch.Tensor:
        q = self.weight.q
        return self._chunked_linear(x, lambda rows: q[rows].to(x.dtype)) * self.weight.scale  # scale after the matmul

    # -- int4 ---------------------------------------------------------------------------------
    def _finish_int4(self, gemv: cpu_gemv.CpuKernels | None) -> None:
        """Pack two 4-bit values a byte: torch's kernel layout, banyan's CPU kernel's (8 rows interleaved, see
        cpu_gemv.c), or blocks of 32 for dequantizing: bytes 16b..16b+15 of row n hold q[n, 32b + j] (low nibble)
        and q[n, 32b + 16 + j] (high nibble)."""
        w = self.weight
        if self.packed_kernels and self.out_features % 16 == 0:  # the CPU kernel's tiling needs N % 16 == 0
            self.packed = torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
            self.scale_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1).contiguous()  # [groups, out, 2]
            self.weight, self._matmul = None, self._int4_packed
            return
        halves = w.q.view(self.out_features, -1, 2, 16)  # [out, blocks, low/high, 16]
        self.packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(self.out_features, -1).contiguous()
        self.offset = (w.zero - 8 * w.scale).contiguous()  # w = s * q + (z - 8s): one multiply-add per value
        w.q = w.zero = None  # the unpacked values take twice the packed size
        self._matmul = self._int4_dequant
        if gemv is not None:  # it serves every row count: only its layout is kept, and no path reads the blocks
            self.interleaved = cpu_gemv.interleave_int4(self.packed, w.scale, self.offset, self.fmt.group_size)
            self.packed = self.offset = w.scale = None
            self._matmul = self._int4_gemv

    def _int4_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.fmt.group_size, self.scale_zeros)

    def _int4_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv.int4(x, self.interleaved)

    def _int4_dequant(self, x: torch.Tensor) -> torch.Tensor:
        packed, scale, offset, group = self.packed, self.weight.scale, self.offset, self.fmt.group_size

        def dequantize(rows: slice) -> torch.Tensor:
            part = packed[rows]
            nibbles = part.view(part.shape[0], -1, 1, 16)  # a block's low nibbles, then its high ones
            q = torch.cat([nibbles & 15, nibbles >> 4], dim=-2).view(part.shape[0], -1, group)  # [rows, groups, group]
            w = torch.addcmul(offset[rows, :, None], q.to(x.dtype), scale[rows, :, None])
            return w.view(part.shape[0], self.in_features)

        return self._chunked_linear(x, dequantize)

    # -- fp16 --------------------------------------------------------------------------------
    def _finish_fp16(self, device: torch.device) -> None:
        if not fbgemm_fp16_works(device, self.dtype) or self.batch_invariant:  # invariant: banyan's kernel reads q
            self._matmul = self._fp16_dequant
            return
        self.packed = torch.ops.quantized.linear_prepack_fp16(self.weight.q.float(), None)  # bias added in forward
        self.packed_bytes = self.weight.q.numel() * 2
        if not self.keep_rows:
            self.weight = None
        self._matmul = self._fp16_fbgemm

    def _fp16_fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)

    def _fp16_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv.float(x, self.weight.q)

    def _fp16_dequant(self, x: torch.Tensor) -> torch.Tensor:
        q = self.weight.q
        return self._chunked_linear(x, lambda rows: q[rows].to(x.dtype))

    # -- fp8 ----------------------------------------------------------------------------------
    def _fp8_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """Both operands fp8: x gets one scale per token (row), the weight one per output channel."""
        if x.is_cuda:  # one kernel for what is eight small ones below (imported here: triton is a GPU dependency)
            from banyan.kernels.fp8_quant import per_token_fp8

            x_fp8, x_scale = per_token_fp8(x if x.stride(-1) == 1 else x.contiguous())
        else:
            x_fp8, x_scale = per_token_fp8_reference(x)
        out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16  # CUDA's row-wise scaling outputs bf16
        y = torch._scaled_mm(x_fp8, self.weight.q.t(), scale_a=x_scale, scale_b=self.weight.scale[None, :],
                             out_dtype=out_dtype)
        return y.to(x.dtype)

    def _fp8_dequant(self, x: torch.Tensor) -> torch.Tensor:
        q = self.weight.q
        return self._chunked_linear(x, lambda rows: q[rows].to(x.dtype)) * self.weight.scale.to(x.dtype)

    def _chunked_linear(self, x: torch.Tensor, dequantize: Callable[[slice], torch.Tensor]) -> torch.Tensor:
        """x W^T with W dequantized a block of rows at a time. On a CPU each float block (2 MiB) stays
        in cache while the matmul reads it; one whole float copy of a large matrix costs more in page
        faults than the matmul itself (lm_head of the default model: 215 ms against 37 ms chunked)."""
        step = self.out_features if x.device.type != "cpu" else max(1, _CPU_CHUNK_VALUES // self.in_features)
        if step >= self.out_features:
            return F.linear(x, dequantize(slice(None)))
        parts = [F.linear(x, dequantize(slice(r, r + step))) for r in range(0, self.out_features, step)]
        return torch.cat(parts, dim=1)


def per_token_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, features] as float8_e4m3fn with one float32 scale per token [tokens, 1]: the row's largest
    magnitude maps to FP8_MAX (banyan.kernels.fp8_quant does the same in one kernel on a GPU)."""
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [tokens, 1]
    return (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), x_scale


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from a quantized lm_head's rows (tied weights): one copy serves both."""

    def __init__(self, lm_head: QuantizedLinear):
        super().__init__()
        lm_head.keep_rows = True  # its kernel may lay the weight out anew: lookups read the rows it keeps (weight_rows)
        self.weight, self.dtype = lm_head.weight, lm_head.dtype  # the same tensors, filled by loading lm_head
        self.rows = lm_head.weight_rows  # from the layout lm_head's kernel keeps, once loaded

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).dequantize(self.dtype)  # [num_tokens, hidden]


class FixedOrderLinear(nn.Module):
    """A float32 nn.Linear's own weight and bias (tied ones stay tied), multiplied by banyan's CPU kernel: each row
    in one fixed order whatever rows share the call (batch-invariant mode; torch's GEMMs block by the row count)."""

    def __init__(self, linear: nn.Linear, kernels: cpu_gemv.CpuKernels):
        super().__init__()
        self.in_features, self.out_features, self.kernels = linear.in_features, linear.out_features, kernels
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.float(x.reshape(-1, self.in_features).contiguous(), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
