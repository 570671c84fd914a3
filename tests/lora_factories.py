"""Test factories for LoRA: random PEFT adapters for the tiny models of factories.py, written by peft itself."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_model(base, rank: int = 8, alpha: float = 16, targets=ALL_TARGETS, seed: int = 1, rslora: bool = False):
    """A peft LoRA model over a copy of `base` with random A and B (peft starts B at zero: no effect)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def write_adapter(path: Path, base, **options):
    """Save a random adapter (PEFT's layout: adapter_config.json + adapter_model.safetensors); returns the peft model."""
    model = make_peft_model(base, **options)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def write_merged_model(path: Path, peft_model, tokenizer_dir: Path) -> None:
    """The base model with the adapter merged into its weights (W + scale * B @ A), as a model directory."""
    from transformers import AutoTokenizer

    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.save_pretrained(str(path), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
