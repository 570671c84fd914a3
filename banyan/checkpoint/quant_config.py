"""A Hugging Face checkpoint quantized by its own tool: config.json's `quantization_config`, read and checked
without torch (the API server opens checkpoints too), so an unsupported layout fails before any tensor is read.

    read_quantization(config, directory) -> CheckpointQuantization | None      (None: a float checkpoint)

Read: AWQ 4-bit in AutoAWQ's GEMM packing, GPTQ 4-bit (zeros stored as z - 1 in the `gptq` checkpoint format,
as z in `gptq_v2`; act-order g_idx), and compressed-tensors `int-quantized` W8A8/W8A16 (int8 weights with one
scale per output channel or per tensor; activations dynamic or none). Anything else is a ModelLoadError
naming the layout; banyan/quantization/prequantized.py turns the tensors into banyan's formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from banyan.errors import ModelLoadError

PREQUANTIZED_METHODS = ("awq", "gptq", "compressed-tensors")
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> zeros stored minus one


@dataclass(frozen=True)
class CheckpointQuantization:
    """How the checkpoint's linear layers are stored, as far as banyan reads them."""

    method: str  # one of PREQUANTIZED_METHODS
    group_size: int = 0  # inputs per scale in the file (awq, gptq); 0: one scale per output channel
    zeros_minus_one: bool = False  # gptq's v1 checkpoint format: the stored zero point is z - 1
    description: str = ""  # for logs and errors, e.g. "AWQ 4-bit (gemm, groups of 128)"


def read_quantization(config: dict[str, Any], directory: Path) -> CheckpointQuantization | None:
    """config.json's quantization_config (or, from older AutoGPTQ, quantize_config.json beside it)."""
    qc = config.get("quantization_config")
    if qc is None and (directory / "quantize_config.json").is_file():
        from banyan.checkpoint import read_json  # the package imports this module first

        qc = {"quant_method": "gptq", **read_json(directory / "quantize_config.json")}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{directory}: quantization_config is not a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    readers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise unsupported(directory, f"quant_method {method or 'missing'!r}",
                          f"banyan reads {', '.join(PREQUANTIZED_METHODS)} checkpoints")
    return readers[method](qc, directory)


def unsupported(directory: Path, layout: str, why: str = "") -> ModelLoadError:
    return ModelLoadError(f"{directory}: banyan cannot load this checkpoint's quantization: {layout}"
                          + (f" ({why})" if why else ""))


def _group_size(qc: dict, key: str, directory: Path, name: str) -> int:
    group = int(qc.get(key, -1) if qc.get(key) is not None else -1)
    if group == -1:
        return 0  # one scale per output channel
    if group <= 0 or group % 32:
        raise unsupported(directory, f"{name} group size {group}", "banyan's int4 groups are multiples of 32 inputs")
    return group


def _awq(qc: dict, directory: Path) -> CheckpointQuantization:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise unsupported(directory, f"AWQ {bits}-bit", "banyan reads 4-bit AWQ")
    if version != "gemm":
        raise unsupported(directory, f"AWQ version {version}", "banyan reads AutoAWQ's GEMM packing")
    if not qc.get("zero_point", True):
        raise unsupported(directory, "AWQ without zero points (zero_point false)")
    group = _group_size(qc, "group_size" if "group_size" in qc else "q_group_size", directory, "AWQ")
    return CheckpointQuantization("awq", group, description=f"AWQ 4-bit (gemm, {_groups(group)})")


def _gptq(qc: dict, directory: Path) -> CheckpointQuantization:
    bits = int(qc.get("bits", 4))
    layout = str(qc.get("checkpoint_format", "gptq")).lower()
    if bits != 4:
        raise unsupported(directory, f"GPTQ {bits}-bit", "banyan reads 4-bit GPTQ")
    if layout not in _GPTQ_FORMATS:
        raise unsupported(directory, f"GPTQ checkpoint_format {layout}", f"banyan reads {', '.join(_GPTQ_FORMATS)}")
    group = _group_size(qc, "group_size", directory, "GPTQ")
    order = ", act-order" if qc.get("desc_act") else ""
    return CheckpointQuantization("gptq", group, zeros_minus_one=_GPTQ_FORMATS[layout],
                                  description=f"GPTQ 4-bit ({layout}, {_groups(group)}{order})")


def _groups(group: int) -> str:
    return f"groups of {group}" if group else "per channel"


def _compressed_tensors(qc: dict, directory: Path) -> CheckpointQuantization:
    """int-quantized: int8 weights, w = weight_scale * weight; activations dynamic (banyan's kernels round them)."""
    def refuse(layout: str, why: str = "") -> ModelLoadError:
        return unsupported(directory, f"compressed-tensors {layout}", why)

    fmt = qc.get("format")
    if fmt == "float-quantized":
        raise refuse("float8 weights (format float-quantized)")
    if fmt != "int-quantized":
        raise refuse(f"format {fmt}", "banyan reads int-quantized (int8 weights)")
    if qc.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (a quantized KV cache)")
    if qc.get("sparsity_config") and qc["sparsity_config"].get("format", "dense") != "dense":
        raise refuse(f"sparsity format {qc['sparsity_config'].get('format')}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise refuse(f"quantization_status {qc['quantization_status']}", "banyan reads compressed checkpoints")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("without config_groups")
    for name, group in groups.items():
        _check_int8_scheme(group or {}, lambda layout, why="", n=name: refuse(f"{n}: {layout}", why))
    return CheckpointQuantization("compressed-tensors", description="compressed-tensors int8 weights (int-quantized)")


def _check_int8_scheme(group: dict, refuse) -> None:
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if weights.get("type", "int") != "int":
        raise refuse(f"{weights['type']}{weights.get('num_bits', '')} weights")
    if weights.get("num_bits") != 8:
        raise refuse(f"int{weights.get('num_bits')} weights", "banyan reads int8 ones")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise refuse(f"int8 weights with strategy {weights.get('strategy')}", "banyan reads channel or tensor")
    if not weights.get("symmetric", True):
        raise refuse("asymmetric int8 weights (weight_zero_point)")
    if group.get("output_activations"):
        raise refuse("quantized output activations")
    if inputs and inputs.get("type", "int") != "int":
        raise refuse(f"{inputs['type']}{inputs.get('num_bits', '')} input activations")
    if inputs and not inputs.get("dynamic", False):
        raise refuse("static input activations (input_scale)", "banyan reads dynamic ones")
