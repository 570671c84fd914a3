"""Model classes by the `architectures` name in config.json, imported on demand."""

from __future__ import annotations

from banyan.registry import Registry

MODELS: Registry[type] = Registry("architecture")
MODELS.register("LlamaForCausalLM", "banyan.models.llama:LlamaForCausalLM")
MODELS.register("MistralForCausalLM", "banyan.models.llama:MistralForCausalLM")
MODELS.register("Qwen2ForCausalLM", "banyan.models.qwen:Qwen2ForCausalLM")
MODELS.register("Qwen3ForCausalLM", "banyan.models.qwen:Qwen3ForCausalLM")


def supported_architectures() -> list[str]:
    return sorted(MODELS.names())


def get_model_class(architecture: str) -> type:
    """The CausalLM subclass for `architecture`; UnknownChoiceError names the ones banyan has."""
    return MODELS.get(architecture)
