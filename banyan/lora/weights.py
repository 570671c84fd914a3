"""An adapter's tensors read from adapter_model.safetensors, placed as banyan's layers hold them (loader thread).

    (layer i, "k_proj") A [r, in], B [out, r]  ──►  modules["model.layers.i.self_attn.qkv_proj"]["k_proj"] = (A, scale * B)

The scale is folded into B here once, so a step computes x @ A^T @ B^T and nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from banyan.errors import LoRAAdapterError
from banyan.lora.adapter import TARGETS, WEIGHTS_FILE, AdapterSpec


@dataclass
class AdapterWeights:
    spec: AdapterSpec
    modules: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor]]]
    """banyan module path -> {checkpoint projection inside it (None: the whole module): (A [r, in], scale * B [out, r])}"""


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype) -> AdapterWeights:
    """Read the tensors the spec names (its file checked when the spec was made) in `dtype`, on the CPU."""
    from safetensors import SafetensorError, safe_open

    modules: dict[str, dict] = {}
    try:
        with safe_open(str(spec.path / WEIGHTS_FILE), framework="pt") as f:
            for (layer, target), (a_name, b_name) in spec.tensors.items():
                a, b = f.get_tensor(a_name), f.get_tensor(b_name)
                if a.shape[0] != spec.rank or b.shape[1] != spec.rank:  # the file changed since it was checked
                    raise LoRAAdapterError(f"LoRA adapter {spec.path}: {a_name} changed on disk", "lora_path")
                where = TARGETS[target]
                b = (b.double() * spec.scale).to(dtype)
                modules.setdefault(f"model.layers.{layer}.{where.module}", {})[where.shard] = (a.to(dtype), b)
    except (SafetensorError, OSError) as e:
        raise LoRAAdapterError(f"LoRA adapter {spec.path}: {e}", "lora_path") from None
    return AdapterWeights(spec, modules)
