"""Model classes by the `architectures` name in config.json, imported on demand."""

from __future__ import annotations

import importlib

from banyan.errors import UnsupportedModelError

_MODELS = {  # architecture -> (module, class)
    "LlamaForCausalLM": ("banyan.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("banyan.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("banyan.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("banyan.models.qwen", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    """The CausalLM subclass for `architecture`; UnsupportedModelError names the ones banyan has."""
    if architecture not in _MODELS:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
