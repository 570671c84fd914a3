"""Activation functions by their Hugging Face `hidden_act` name."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from banyan.errors import UnsupportedModelError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
