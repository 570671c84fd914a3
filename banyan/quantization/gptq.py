"""AutoGPTQ's layout (quant_method gptq, 4 bits; checkpoint_format gptq or gptq_v2) -> banyan's int4.

    qweight [in / 8, out] int32   word r of column n: inputs 8r .. 8r+7, nibble j holds input 8r + j
    qzeros  [groups, out / 8]     nibble j of word c: output 8c + j's zero point; `gptq` (v1) stores z - 1
    scales  [groups, out] fp16
    g_idx   [in] int32            each input's group
    w[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])

v1's "minus one" is read back as AutoGPTQ's kernels read it, z = (stored + 1) & 15 (a true zero of 0 was
stored as 15). With act-order (desc_act) the file quantized the inputs in its own order, so g_idx is not
k // g: a group's inputs are scattered. banyan's groups are contiguous, so the inputs are sorted by group
at load time (a stable sort, kept as the layer's input order) and the layer permutes x the same way:

    g_idx    = [1 0 1 0]      order = [1 3 0 2]      w[:, order] = [ group 0 | group 1 ]
    y = x W^T = x[:, order] (W[:, order])^T

Without act-order the sort is the identity and nothing is permuted. The alternative, regrouping in place,
cannot be exact: banyan's groups of 32 contiguous inputs would each need one scale and zero per row.
"""

from __future__ import annotations

import torch

from banyan.checkpoint.quant_config import CheckpointQuantization
from banyan.errors import ModelLoadError
from banyan.quantization.formats import Int4Weight, WeightFormat
from banyan.quantization.packing import (InputOrdered, banyan_group_size, file_group_size, unpack_int4,
                                         zero_point_groups)

MARKER = "qweight"
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def layer_format(quant: CheckpointQuantization, shapes: dict[str, list[int]]) -> WeightFormat:
    in_features = 8 * shapes["qweight"][0]
    return WeightFormat("int4", banyan_group_size(file_group_size(quant.group_size, in_features, shapes["scales"][0]),
                                                  in_features))


def unpack(quant: CheckpointQuantization, parts: dict[str, torch.Tensor],
           fmt: WeightFormat) -> Int4Weight | InputOrdered:
    q = unpack_int4(parts["qweight"], dim=0)  # [in, out]
    zeros = unpack_int4(parts["qzeros"], dim=1)  # [groups, out]
    if quant.zeros_minus_one:
        zeros = (zeros + 1) & 15
    scales = parts["scales"]
    file_group = file_group_size(quant.group_size, q.shape[0], scales.shape[0])
    order = input_order(parts.get("g_idx"), q.shape[0], file_group)
    if order is not None:
        q = q[order]
    weight = zero_point_groups(q.t(), scales.t(), zeros.t(), file_group, fmt.group_size)
    return weight if order is None else InputOrdered(weight, order)


def input_order(g_idx: torch.Tensor | None, in_features: int, file_group: int) -> torch.Tensor | None:
    """The permutation that makes every group's inputs contiguous, in group order; None when they already are."""
    if g_idx is None:
        return None
    order = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[order], torch.arange(in_features) // file_group):
        raise ModelLoadError(f"g_idx does not give each group {file_group} inputs (the last one the rest)")
    return None if torch.equal(order, torch.arange(in_features)) else order
