"""Pieces shared by the 4-bit layouts of AWQ and GPTQ checkpoints (awq.py, gptq.py):

    unpack_int4(words, dim)            int32 words of eight 4-bit values -> the values, 8x longer along dim
    banyan_group_size(file group, in)  banyan's group size for the file's groups (32)
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

# banyan's int4 groups for these layers: 32, whatever the file's (a divisor of them, so the values stay the file's).
# banyan's AVX2 kernel runs groups of 32 1.3-1.6x faster than groups of 64 or 128 at batch 1 (measured on the
# 2-vCPU AMD EPYC, 512x1536 to 49152x512), for 1.5 bits more a value than groups of 128 (a float32 scale and offset).
BANYAN_GROUP = 32


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
    """banyan's group size for the file's groups: BANYAN_GROUP where it falls on every boundary of theirs."""
    if math.gcd(file_group, in_features) % BANYAN_GROUP:
        raise ModelLoadError(f"int4 groups of {file_group} over {in_features} inputs: banyan's groups of "
                             f"{BANYAN_GROUP} do not fall on their boundaries")
    return BANYAN_GROUP


def zero_point_groups(q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, file_group: int,
                      group: int) -> Int4Weight:
    """q [out, in] in 0..15; scale, zeros [out, file groups]: w = scale * (q - zeros) per `file_group` inputs, as
    banyan's Int4Weight in groups of `group` (dividing the file's), each taking its file group's scale and zero:

        file groups of 128:  [            0            |            1            |   2 (64)    ]
        banyan's of 32:      [  0  |  0  |  0  |  0  |  1  |  1  |  1  |  1  |  2  |  2  ]
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
