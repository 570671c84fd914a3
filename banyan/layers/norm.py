"""RMSNorm (Zhang & Sennrich, 2019), computed in fp32 and cast back, exactly as Hugging Face does.

On a float32 CPU model the norm (and the residual add before it) is one call of banyan's fused kernel
(banyan/kernels/cpu_decode.c) instead of seven torch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from banyan.kernels import cpu_decode


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalizing the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        fits = hidden_size % 8 == 0  # the kernel's lanes
        self.kernels = cpu_decode.kernels_for(self.weight.device, self.weight.dtype) if fits else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, the norm of that sum): the residual stream and the next block's input, in one pass."""
        if self._fused(x) and residual.is_contiguous():
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return x, self(x)

    def _fused(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.dtype is torch.float32 and x.is_cpu and x.is_contiguous()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
