"""AutoAWQ's GEMM layout (quant_method awq, version gemm, 4 bits) -> banyan's int4, value for value.

    qweight [in, out / 8] int32   word j of input row k: outputs 8j .. 8j+7, nibble i holds output 8j + ORDER[i]
    qzeros  [in / g, out / 8]     the zero points, packed the same way
    scales  [in / g, out] fp16
    w[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n])            ORDER = 0 2 4 6 1 3 5 7

banyan stores [out, in] with groups along the inputs: the transposes, and the zero points as s * (8 - z)
(packing.py). Groups of 256 or per channel become groups of 128, the scale repeated.
"""

from __future__ import annotations

import torch

from banyan.checkpoint.quant_config import CheckpointQuantization
from banyan.quantization.formats import Int4Weight, WeightFormat
from banyan.quantization.packing import banyan_group_size, file_group_size, unpack_int4, zero_point_groups

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of a word holds (AutoAWQ's pack order)
MARKER = "qweight"
PARTS = ("qweight", "qzeros", "scales")


def layer_format(quant: CheckpointQuantization, shapes: dict[str, list[int]]) -> WeightFormat:
    in_features = shapes["qweight"][0]
    return WeightFormat("int4", banyan_group_size(file_group_size(quant.group_size, in_features, shapes["scales"][0]),
                                                  in_features))


def unpack(quant: CheckpointQuantization, parts: dict[str, torch.Tensor], fmt: WeightFormat) -> Int4Weight:
    q = unpack_int4(parts["qweight"], dim=1, order=ORDER)  # [in, out]
    zeros = unpack_int4(parts["qzeros"], dim=1, order=ORDER)  # [groups, out]
    scales = parts["scales"]
    file_group = file_group_size(quant.group_size, q.shape[0], scales.shape[0])
    return zero_point_groups(q.t(), scales.t(), zeros.t(), file_group, fmt.group_size)
