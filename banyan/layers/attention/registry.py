"""Attention backends by name, imported only when asked for (a kernel library may be absent)."""

from __future__ import annotations

import importlib
import importlib.util

from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import AttentionBackend

_BACKENDS = {  # name -> (module, class)
    "torch": ("banyan.layers.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("banyan.layers.attention.triton_backend", "TritonAttentionBackend"),
}
_NEEDS = {"triton": "triton"}  # name -> the package its kernels import


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidParameterError("attention_backend", f"unknown backend {name!r}; choose from {sorted(_BACKENDS)}")
    needed = _NEEDS.get(name)
    if needed is not None and importlib.util.find_spec(needed) is None:
        raise InvalidParameterError(
            "attention_backend", f"backend {name!r} needs the {needed!r} package: pip install 'banyan[gpu]'"
        )
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)
