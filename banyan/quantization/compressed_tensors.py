"""compressed-tensors' int-quantized layout (llm-compressor's W8A8 / W8A16, int8 symmetric weights) -> banyan's int8.

    weight        [out, in] int8      q in [-128, 127]
    weight_scale  [out, 1] (strategy channel) or [1] (strategy tensor), float
    w[n, k] = weight_scale[n] * weight[n, k]

which is banyan's int8 as it is (one scale per row; a tensor's one scale repeated). The activations, dynamic
int8 per token in the file's scheme, are banyan's kernels' to quantize: banyan's AVX2 kernel rounds x to int8
per block of 32 inputs (finer than per token), torch's int8 kernel and the dequantizing path keep x in floats.
"""

from __future__ import annotations

import torch

from banyan.checkpoint.quant_config import CheckpointQuantization
from banyan.errors import ModelLoadError
from banyan.quantization.formats import INT8, Int8Weight, WeightFormat

MARKER = "weight_scale"
PARTS = ("weight", "weight_scale")


def layer_format(quant: CheckpointQuantization, shapes: dict[str, list[int]]) -> WeightFormat:
    return INT8


def unpack(quant: CheckpointQuantization, parts: dict[str, torch.Tensor], fmt: WeightFormat) -> Int8Weight:
    q, scale = parts["weight"], parts["weight_scale"]
    if q.dtype != torch.int8:
        raise ModelLoadError(f"weight is {q.dtype}, not int8 as the int-quantized format stores it")
    if scale.numel() not in (1, q.shape[0]):
        raise ModelLoadError(f"weight_scale has {scale.numel()} values for {q.shape[0]} output channels")
    return Int8Weight(q, scale.float().reshape(-1).expand(q.shape[0]).contiguous())
