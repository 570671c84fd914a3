"""A PEFT LoRA adapter read and checked against the base model, without torch (the API server checks adapters too).

    adapter_dir/
      adapter_config.json          {"r": 16, "lora_alpha": 32, "use_rslora": false, "target_modules": [...], ...}
      adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
                                   base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

A targeted projection becomes W + scale * B @ A, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
PEFT names the checkpoint's projections; banyan fuses some of them (q/k/v -> qkv_proj, gate/up -> gate_up_proj):
TARGETS says where each one's delta goes. Anything else (pickles, DoRA, per-module ranks, embeddings, biases,
modules_to_save) is refused with a LoRAAdapterError that names it, before any tensor is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from banyan.checkpoint import PICKLE_SUFFIXES, read_json
from banyan.checkpoint.safetensors_header import check_safetensors
from banyan.config import ModelArch
from banyan.errors import LoRAAdapterError, ModelLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = ("F32", "F16", "BF16")


class Target(NamedTuple):
    """Where a PEFT target's delta goes in banyan's model: the module under each decoder layer, and the
    checkpoint projection (its rows) inside it when the module is a merged one (None: the whole module)."""

    module: str
    shard: str | None


TARGETS = {
    "q_proj": Target("self_attn.qkv_proj", "q_proj"),
    "k_proj": Target("self_attn.qkv_proj", "k_proj"),
    "v_proj": Target("self_attn.qkv_proj", "v_proj"),
    "o_proj": Target("self_attn.o_proj", None),
    "gate_proj": Target("mlp.gate_up_proj", "gate_proj"),
    "up_proj": Target("mlp.gate_up_proj", "up_proj"),
    "down_proj": Target("mlp.down_proj", None),
}
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_UNSUPPORTED = {  # config key -> the value meaning "feature off"; anything else is refused
    "use_dora": False, "modules_to_save": None, "bias": "none", "fan_in_fan_out": False,
    "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False,
}


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its scale and which tensors feed which (layer, PEFT target)."""

    path: Path
    rank: int
    scale: float
    tensors: dict[tuple[int, str], tuple[str, str]]
    """(layer, PEFT target such as "q_proj") -> (lora_A tensor name, lora_B tensor name)"""
    fingerprint: tuple
    """What identifies these weights (path, size and mtime of the file): the prefix-cache namespace of its requests."""

    @property
    def target_modules(self) -> list[str]:
        return sorted({target for _, target in self.tensors})


def projection_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """PEFT target -> (in_features, out_features) of that projection in the base model."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_adapter(path: str | Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
    """Check an adapter directory against the base model; LoRAAdapterError (param lora_path) says what is wrong."""
    path = Path(path)
    try:
        return _read(path, arch, max_rank)
    except ModelLoadError as e:  # unreadable JSON, a malformed safetensors header
        raise LoRAAdapterError(f"LoRA adapter {path}: {e}", "lora_path") from None


def _read(path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
    def bad(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {path}: {why}", "lora_path")

    if not path.is_dir():
        raise bad("not a directory")
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise bad(f"holds {pickles[0]}, a pickle file: banyan loads adapter_model.safetensors only and refuses "
                  "pickles (they run code when loaded); save the adapter with safe_serialization=True")
    if not (path / CONFIG_FILE).is_file():
        raise bad(f"no {CONFIG_FILE}")
    if not (path / WEIGHTS_FILE).is_file():
        raise bad(f"no {WEIGHTS_FILE}")
    rank, scale = _read_config(read_json(path / CONFIG_FILE), max_rank, bad)
    file = path / WEIGHTS_FILE
    header = check_safetensors(file)
    tensors = _match_tensors(header, arch, rank, bad)
    stat = file.stat()
    return AdapterSpec(path, rank, scale, tensors, (str(path.resolve()), stat.st_size, stat.st_mtime_ns))


def _read_config(config: dict, max_rank: int, bad) -> tuple[int, float]:
    """(rank, scale) from adapter_config.json."""
    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {config.get('peft_type')!r}: only LORA adapters are supported")
    for key, off in _UNSUPPORTED.items():
        if config.get(key, off) not in (off, None, [], {}):
            raise bad(f"{key}={config[key]!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise bad(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise bad(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise bad(f"unknown target modules {unknown}: banyan applies LoRA to {', '.join(TARGETS)}")
    rslora = config.get("use_rslora", False) is True
    return rank, alpha / math.sqrt(rank) if rslora else alpha / rank


def _match_tensors(header: dict, arch: ModelArch, rank: int, bad) -> dict[tuple[int, str], tuple[str, str]]:
    """Every tensor named, typed and shaped as a LoRA A or B of a known target; A and B in pairs."""
    shapes = projection_shapes(arch)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = _TENSOR.fullmatch(name)
        if m is None or m[3] not in TARGETS or not TARGETS[m[3]].module.startswith(m[2] + "."):
            raise bad(f"tensor {name!r} is not a LoRA A/B weight of a known target module ({', '.join(TARGETS)})")
        layer, target, which = int(m[1]), m[3], m[4]
        if layer >= arch.num_hidden_layers:
            raise bad(f"tensor {name!r}: the model has {arch.num_hidden_layers} layers")
        if info["dtype"] not in FLOAT_DTYPES:
            raise bad(f"tensor {name!r} is {info['dtype']}, not one of {', '.join(FLOAT_DTYPES)}")
        fan_in, fan_out = shapes[target]
        expected = [rank, fan_in] if which == "A" else [fan_out, rank]
        if info["shape"] != expected:
            raise bad(f"tensor {name!r} has shape {info['shape']}, expected {expected} (r={rank})")
        found.setdefault((layer, target), {})[which] = name
    if not found:
        raise bad("holds no LoRA weights")
    unpaired = [f"layer {layer} {target}" for (layer, target), ab in found.items() if len(ab) != 2]
    if unpaired:
        raise bad(f"lora_A and lora_B must come in pairs; unpaired: {unpaired[:3]}")
    return {key: (ab["A"], ab["B"]) for key, ab in sorted(found.items())}
