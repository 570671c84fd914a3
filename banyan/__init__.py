"""banyan: an LLM inference and serving engine."""

from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from banyan.lora.request import LoRARequest
from banyan.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LoRARequest", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig"]


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from banyan.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
