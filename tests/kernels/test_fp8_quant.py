"""The per-token fp8 quantization kernel (fp8 weights' activations on CUDA) against the torch reference: the same
fp8 values and scales, bit for bit."""

from __future__ import annotations

import pytest
import torch

from banyan.kernels.fp8_quant import per_token_fp8
from banyan.quantization.linear import per_token_fp8_reference
from tests.kernels.paged_batches import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 64), (3, 576), (5, 1536), (2, 2500)])  # 2500: two blocks, one partial
def test_kernel_matches_the_reference_bit_for_bit(rows, cols, dtype):
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)  # rows of all sizes
    x[0, cols // 2] = -x[0].abs().max() * 3  # the largest magnitude negative: it maps to -448 exactly
    q, scale = per_token_fp8(x.to(DEVICE))
    q_ref, scale_ref = per_token_fp8_reference(x)
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert q.cpu()[0, cols // 2].float() == -448.0


def test_a_row_of_zeros_keeps_a_positive_scale_and_rows_of_a_wider_tensor_are_read_in_place():
    x = torch.zeros(3, 100)
    x[1] = torch.linspace(-1, 1, 100)
    wide = torch.zeros(3, 160)
    wide[:, :100] = x
    for rows in (x, wide[:, :100]):  # a row stride past its columns
        q, scale = per_token_fp8(rows.to(DEVICE))
        q_ref, scale_ref = per_token_fp8_reference(x)
        assert torch.equal(scale.cpu(), scale_ref) and scale[0, 0] > 0
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_empty_and_misshapen_inputs():
    q, scale = per_token_fp8(torch.zeros(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="contiguous last dim"):
        per_token_fp8(torch.zeros(4, 8, device=DEVICE).t())
