"""Pieces shared by the 4-bit layouts of AWQ and GPTQ checkpoints (awq.py, gptq.py):

    unpack_int4(words, dim)            int32 words of eight 4-bit values -> the values, 8x longer along dim
    banyan_group_size(file group, in)  banyan's group size for the file's groups
    zero_point_groups(q, s, z, ...)    w = s * (q - z) per group of inputs -> banyan's Int4Weight, exactly
    InputOrdered(weight, order)        a weight whose input columns are stored permuted (GPTQ act-order)

Both tools store w = s * (q - z) with an integer zero point z in [0, 15]; banyan's int4 stores
w = s * (q - 8) + zero, so zero = s * (8 - z): a product of a float16 scale and an integer of at most
4 bits, exact in float32 (as is the -s * z the kernels then read back), so every value is the file's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from banyan.errors import ModelLoadError
from banyan.quantization.formats import Int4Weight, QuantizedWeight

BANYAN_GROUPS = (128, 64, 32)  # banyan's int4 group sizes, largest first


def unpack_int4(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The eight 4-bit values of each int32 word, in place of the word along `dim` (int16, 0..15).

        bits:   31..28   ...   7..4    3..0
        word: | nib 7 | ... | nib 1 | nib 0 |     nibble i holds value order[i] of the word's eight
    order is 0..7 for GPTQ; AWQ interleaves (awq.py)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 15  # [..., 8]: nibble i of each word
    values = nibbles[..., [order.index(j) for j in range(8)]]  # value j is nibble order.index(j)
    values = values.movedim(-1, dim + 1) if dim != words.dim() - 1 else values
    shape = list(words.shape)
    shape[dim] *= 8
    return values.reshape(shape).to(torch.int16)


def file_group_size(config_group: int, in_features: int, groups: int) -> int:
    """Inputs per group in the file: the config's group size (0: the whole row). The scales hold one column per
    group, the last one possibly shorter (AutoGPTQ: 576 inputs in groups of 128 are 4 x 128 + 64)."""
    group = config_group or in_features
    if -(-in_features // group) != groups:
        raise ModelLoadError(f"{groups} groups of scales for {in_features} inputs in groups of {group}")
    return group


def banyan_group_size(file_group: int, in_features: int) -> int:
    """The largest of banyan's group sizes that falls on every boundary of the file's groups: groups of 256, or
    one per channel, become groups of 128 with their scale repeated; 576 inputs in groups of 128, groups of 64."""
    span = math.gcd(file_group, in_features)
    for group in BANYAN_GROUPS:
        if span % group == 0:
            return group
    raise ModelLoadError(f"int4 groups of {file_group} over {in_features} inputs: none of banyan's group sizes "
                         f"{BANYAN_GROUPS} falls on their boundaries")


def zero_point_groups(q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, file_group: int,
                      group: int) -> Int4Weight:
    """q [out, in] in 0..15; scale, zeros [out, file groups]: w = scale * (q - zeros) per `file_group` inputs, as
    banyan's Int4Weight in groups of `group` (a divisor of the file's), each taking its file group's scale and zero:

        file groups of 128:  [        0        |        1        | 2 (64) ]
        banyan's of 64:      [   0    |   0    |   1    |   1    |   2    ]
    """
    which = torch.arange(0, q.shape[1], group, device=q.device) // file_group  # the file's group of each of banyan's
    scale, zeros = scale.float()[:, which], zeros.float()[:, which]
    return Int4Weight(q.to(torch.uint8), scale, scale * (8 - zeros))


@dataclass
class InputOrdered:
    """A weight whose input columns are stored permuted: column j holds input order[j] (GPTQ act-order, sorted by
    group so that each group's inputs are contiguous). Its layer multiplies x[:, order] by it: the same y."""

    weight: QuantizedWeight
    order: torch.Tensor  # [in] int64, a permutation

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in the inputs' own order."""
        permuted = self.weight.dequantize(dtype)
        w = torch.empty_like(permuted)
        w[:, self.order] = permuted
        return w


def common_input_order(orders: list[torch.Tensor | None], name: str) -> torch.Tensor | None:
    """The one input order of a layer's shards (q/k/v, gate/up share their input): ModelLoadError if they differ."""
    first = orders[0]
    for order in orders[1:]:
        if (order is None) != (first is None) or order is not None and not torch.equal(order, first):
            raise ModelLoadError(f"{name}: GPTQ act-order with shards whose g_idx order their inputs differently; "
                                 "banyan multiplies them as one matrix over one permuted input")
    return first
