"""Activation functions by their Hugging Face `hidden_act` name."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from banyan.kernels import cpu_decode
from banyan.registry import Registry

ACTIVATIONS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("hidden_act")
ACTIVATIONS.register("silu", F.silu)
ACTIVATIONS.register("swish", F.silu)
ACTIVATIONS.register("gelu", F.gelu)
ACTIVATIONS.register("gelu_pytorch_tanh", lambda x: F.gelu(x, approximate="tanh"))


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS.get(name)


def gated_activation(name: str, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """[..., 2 size] (gate, up) -> act(gate) * up [..., size]: for SiLU on a float32 CPU model one call of
    banyan's fused kernel (banyan/kernels/cpu_decode.c; bf16 rows too, an AMX prefill's), else torch's ops."""
    act = get_activation(name)
    kernels = cpu_decode.kernels_for(torch.get_default_device(), torch.get_default_dtype())
    if act is not F.silu or kernels is None or size % 8:
        return lambda gate_up: _act_mul(act, gate_up)

    def fused(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.is_cpu and gate_up.is_contiguous():
            return kernels.silu_mul(gate_up)
        return _act_mul(act, gate_up)

    return fused


def _act_mul(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, size] each
    return act(gate) * up
