"""Attention backends by name, imported only when asked for (a kernel library may be absent)."""

from __future__ import annotations

import torch

from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import AttentionBackend
from banyan.registry import Registry

ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention_backend")
ATTENTION_BACKENDS.register("torch", "banyan.layers.attention.torch_backend:TorchAttentionBackend")
ATTENTION_BACKENDS.register("triton", "banyan.layers.attention.triton_backend:TritonAttentionBackend")


def get_attention_backend(name: str, device: torch.device | None = None,
                          kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend called `name`; InvalidParameterError with the backend's own reason when it cannot run on
    `device` with a `kv_dtype` cache (None: not asked)."""
    backend = ATTENTION_BACKENDS.get(name)
    reason = backend.unavailable_reason(device, kv_dtype)
    if reason is not None:
        raise InvalidParameterError("attention_backend", reason)
    return backend()


def attention_backend_names() -> list[str]:
    return ATTENTION_BACKENDS.names()
