"""Activation functions by their Hugging Face `hidden_act` name."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from banyan.registry import Registry

ACTIVATIONS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("hidden_act")
ACTIVATIONS.register("silu", F.silu)
ACTIVATIONS.register("swish", F.silu)
ACTIVATIONS.register("gelu", F.gelu)
ACTIVATIONS.register("gelu_pytorch_tanh", lambda x: F.gelu(x, approximate="tanh"))


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS.get(name)
