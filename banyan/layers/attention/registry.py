"""Attention backends by name, imported only when asked for (a kernel library may be absent)."""

from __future__ import annotations

import importlib

from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import AttentionBackend

_BACKENDS = {  # name -> (module, class)
    "torch": ("banyan.layers.attention.torch_backend", "TorchAttentionBackend"),
}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidParameterError("attention_backend", f"unknown backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)
