"""Checkpoints quantized by their own tool (AWQ, GPTQ, compressed-tensors), loaded into banyan's integer formats.

    layers = PackedLayers(source.quantization, header shapes)   # which tensors make up each quantized layer
    layers.formats()                                             # "...q_proj.weight" -> WeightFormat (the plan)
    layers.assemble(tensors read with layers.reading(shard), compact, shard)  -> ("...q_proj.weight", weight), ...

A layer's tensors (AWQ/GPTQ: qweight, qzeros, scales, g_idx; compressed-tensors: weight, weight_scale) come
one by one in the file's order; they are held until the layer is whole, then handed on as one `<layer>.weight`
under its Hugging Face name, as a GGUF file's compact tensors are: banyan's Int4Weight / Int8Weight (possibly
InputOrdered), or with compact=False the float weight (`--quantization none`). Everything else (norms,
embeddings, an unquantized lm_head, biases) passes as it is. Which layers are quantized is read from the
safetensors headers (a layer with a qweight / weight_scale is), so a config's ignore lists need no parsing.
One module per layout says how its tensors map to banyan's: awq.py, gptq.py, compressed_tensors.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from banyan.checkpoint.quant_config import CheckpointQuantization
from banyan.errors import InvalidParameterError, ModelLoadError
from banyan.quantization import awq, compressed_tensors, gptq
from banyan.quantization.formats import QuantizedWeight, WeightFormat
from banyan.quantization.packing import InputOrdered

LAYOUTS = {"awq": awq, "gptq": gptq, "compressed-tensors": compressed_tensors}  # method -> its module
_OPTIONAL = {"g_idx"}  # a GPTQ file without it has contiguous groups


def prequantized_method(asked: str | None, quant: CheckpointQuantization) -> str | None:
    """What loading does with such a checkpoint: keep its integer weights (--quantization unset or its method's
    name), or dequantize them to the model's dtype (`none`). Requantizing them to another format is refused."""
    if asked == "none":
        return None
    if asked not in (None, quant.method):
        raise InvalidParameterError("quantization", f"the checkpoint is {quant.description}, which banyan loads as it "
                                    f"is: leave it unset or pass {quant.method} (or none: dequantized to floats); "
                                    f"{asked} would quantize its already quantized weights again")
    return quant.method


class PackedLayers:
    """The quantized layers of one checkpoint, found in its safetensors headers ({tensor name: shape})."""

    def __init__(self, quant: CheckpointQuantization, header: dict[str, list[int]]):
        self.quant, self.layout = quant, LAYOUTS[quant.method]
        found: dict[str, dict[str, list[int]]] = {}
        for name, shape in header.items():
            prefix, _, leaf = name.rpartition(".")
            found.setdefault(prefix, {})[leaf] = shape
        self.parts = {prefix: {leaf: shape for leaf, shape in parts.items() if leaf != "bias"}
                      for prefix, parts in found.items() if self.layout.MARKER in parts}  # module path -> {part: shape}
        for prefix, parts in self.parts.items():
            self._check_parts(prefix, set(parts))

    def _check_parts(self, prefix: str, parts: set[str]) -> None:
        unknown, missing = parts - set(self.layout.PARTS), set(self.layout.PARTS) - _OPTIONAL - parts
        if unknown or missing:
            what = f"has {sorted(unknown)}, which banyan does not read" if unknown else f"lacks {sorted(missing)}"
            raise ModelLoadError(f"{prefix}: a layer of a {self.quant.description} checkpoint that {what}")

    def formats(self) -> dict[str, WeightFormat]:
        """Hugging Face weight name -> the format banyan keeps it in."""
        formats = {}
        for prefix, parts in self.parts.items():
            try:
                formats[f"{prefix}.weight"] = self.layout.layer_format(self.quant, parts)
            except (ModelLoadError, IndexError) as e:  # IndexError: a part with too few dimensions
                raise ModelLoadError(f"{prefix} ({self.quant.description}): {e}") from None
        return formats

    def reading(self, shard: Callable | None) -> Callable | None:
        """What to read of each tensor (tensor parallel, pipeline stages): a quantized layer's parts whole, or not at
        all where the layer's weight is another stage's; the rest as `shard` says."""
        if shard is None:
            return None

        def part(name: str):
            prefix = name.rpartition(".")[0]
            if prefix not in self.parts or name.endswith(".bias"):
                return shard(name)
            whole = shard(f"{prefix}.weight")
            return whole if whole is not None and whole.skip else None

        return part

    def assemble(self, tensors: Iterator[tuple[str, torch.Tensor]], compact: bool,
                 shard: Callable | None = None) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | InputOrdered]]:
        """One `<layer>.weight` per quantized layer once its parts have all come, the other tensors as they come."""
        formats, pending = self.formats(), {}
        for name, tensor in tensors:
            prefix, _, leaf = name.rpartition(".")
            if leaf not in self.parts.get(prefix, ()):
                yield name, tensor
                continue
            got = pending.setdefault(prefix, {})
            got[leaf] = tensor
            if len(got) == len(self.parts[prefix]):
                del pending[prefix]
                weight_name = f"{prefix}.weight"
                try:
                    weight = self.layout.unpack(self.quant, got, formats[weight_name])
                except (ModelLoadError, RuntimeError, IndexError) as e:  # RuntimeError: parts of mismatched shapes
                    raise ModelLoadError(f"{prefix} ({self.quant.description}): {e}") from None
                yield weight_name, _finish(weight, weight_name, compact, shard)
        if pending:
            raise ModelLoadError(f"{next(iter(pending))}: the checkpoint's index lists only some of its tensors")


def _finish(weight: QuantizedWeight | InputOrdered, name: str, compact: bool,
            shard: Callable | None) -> torch.Tensor | QuantizedWeight | InputOrdered:
    """Floats unless compact, and this rank's part (tensor parallel: rows, or inputs by whole groups)."""
    if not compact:
        weight = weight.dequantize(torch.float32)  # exact: every value is a float16 scale times a small integer
    part = shard(name) if shard is not None else None
    if part is None:
        return weight
    if isinstance(weight, InputOrdered):
        if part.dim == 1:
            raise ModelLoadError(f"{name}: GPTQ act-order (desc_act) with tensor parallelism, which splits the "
                                 "layer's permuted inputs between ranks: banyan cannot load that")
        return InputOrdered(part.take(weight.weight), weight.order)
    try:
        return part.take(weight)
    except ValueError as e:  # inputs split inside a group
        raise ModelLoadError(f"{name}: {e}") from None
