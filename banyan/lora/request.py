"""LoRARequest: which adapter a request runs with (vLLM's names), a msgspec struct so it crosses to the core as is."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """An adapter in PEFT's layout (adapter_config.json + adapter_model.safetensors) in the directory lora_path.

    lora_int_id (>= 1) identifies it in the engine: requests with the same id share its resident weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
