"""Attention backends by name, imported only when asked for (a kernel library may be absent)."""

from __future__ import annotations

import torch

from banyan.errors import InvalidParameterError
from banyan.layers.attention.base import AttentionBackend
from banyan.registry import Registry

AUTO = "auto"  # triton on a GPU where it can run, else torch (choose_attention_backend)
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


def choose_attention_backend(asked: str, device_type: str, capability: tuple[int, int] | None = None,
                             triton_problem: str | None = None, kv_dtype: torch.dtype | None = None
                             ) -> tuple[str, str | None]:
    """(the backend to run, why triton was passed over where it was wanted: the warning to log, or None).

        asked    device  triton can run here?          -> runs
        torch    any     -                             -> torch
        auto     cpu     -                             -> torch   (the CPU's backend: nothing to warn about)
        auto     cuda    yes                           -> triton  (graph-safe: CUDA graphs need it)
        auto     cuda    no: triton_problem or the     -> torch, warning with the reason
        triton   cuda        capability (>= 8.0, >= 8.9 with an fp8 KV cache)
        triton   cuda    yes                           -> triton
        triton   cpu     -                             -> triton  (the registry refuses it unless TRITON_INTERPRET=1)

    capability: the GPU's (major, minor); triton_problem: why triton does not import (None: it does). Pure, so
    that every case is tested without a GPU; the runner probes the device and the import."""
    if asked not in (AUTO, "triton"):
        return asked, None  # torch, or an unknown name the registry refuses
    if device_type != "cuda":
        return ("torch" if asked == AUTO else "triton"), None
    from banyan.layers.attention.triton_backend import capability_problem  # no triton import: plain checks

    problem = triton_problem or (capability_problem(capability, kv_dtype) if capability is not None else None)
    return ("torch", problem) if problem else ("triton", None)
