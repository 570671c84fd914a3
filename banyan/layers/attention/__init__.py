"""Paged attention backends behind one interface, chosen by name."""

from banyan.layers.attention.base import AttentionBackend
from banyan.layers.attention.registry import attention_backend_names, choose_attention_backend, get_attention_backend

__all__ = ["AttentionBackend", "attention_backend_names", "choose_attention_backend", "get_attention_backend"]
