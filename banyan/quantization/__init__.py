"""Weight-only quantization, applied to a built model from outside (its files never change):

    plan = plan_formats(model, "int4", group_size=32)    # module name -> WeightFormat
    quantize_linears(model, plan)                        # those nn.Linear -> empty QuantizedLinear
    model.load_weights(source.iter_weights())            # each checkpoint shard quantized as it arrives
    finish_loading(model)                                # lay weights out for their kernels

Which layers: every decoder projection in the chosen format. lm_head goes to int8 for int8 and
int4 (llama.cpp likewise keeps its output matrix at 6-8 bits: the logits are the most sensitive
matmul), and tied token embeddings read their rows from it, so one int8 copy serves both. fp8
leaves lm_head in the compute dtype, as vLLM does. `gguf` keeps a GGUF file's Q4_0/Q4_1 tensors
as int4 in groups of 32 (exactly: same values) and its Q8_0 ones as int8 (requantized per row);
a tied lm_head there is int8 whatever the file has. `fp16` stores every linear layer (lm_head too) in
float16 for a float32 model: the default on x86 CPUs for checkpoints of 16 bits or fewer (see
`default_method`), where FBGEMM's fp16 GEMM decodes up to 2x faster than float32. `awq`, `gptq` and
`compressed-tensors` keep a checkpoint's own 4-bit or int8 layers as banyan's int4 / int8 with the same values
(prequantized.py), as `gguf` does a GGUF file's; the default for such a checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from banyan.checkpoint.quant_config import PREQUANTIZED_METHODS, CheckpointQuantization
from banyan.errors import InvalidParameterError
from banyan.kernels import cpu_gemv
from banyan.layers.linear import checkpoint_shards
from banyan.quantization.formats import FP16, INT8, WEIGHT_KINDS, WeightFormat
from banyan.quantization.linear import FixedOrderLinear, QuantizedEmbedding, QuantizedLinear, fbgemm_fp16_works
from banyan.quantization.prequantized import prequantized_method
from banyan.registry import UnknownChoiceError

logger = logging.getLogger(__name__)

FILE_METHODS = ("gguf", *PREQUANTIZED_METHODS)  # a GGUF file's or a pre-quantized checkpoint's own tensors, compact
QUANTIZATION_METHODS = (*WEIGHT_KINDS.names(), *FILE_METHODS)
INT4_GROUP_SIZES = (32, 64, 128)

__all__ = ["FILE_METHODS", "QUANTIZATION_METHODS", "Choice", "QuantizedLinear", "default_method", "finish_loading",
           "model_weight_bytes", "plan_formats", "quantize_linears", "use_fixed_order", "why_not_invariant_by_default"]


@dataclass(frozen=True)
class Choice:
    """What loading applies: a method (None: the model's own dtype), and for the CPU default of a GGUF
    file whether to mix in float16 (layers the file does not keep compact, and copies for wide batches)."""

    method: str | None
    mix_fp16: bool = False


def default_method(asked: str | None, device: torch.device, dtype: torch.dtype, checkpoint_dtype: str | None,
                   is_gguf: bool, prequantized: CheckpointQuantization | None = None) -> Choice:
    """The method asked for ("none": None). Unasked, on an x86 CPU running a float32 model, where the checkpoint
    holds 16 bits or fewer a weight (so nothing the file has is lost): a GGUF file's Q4/Q8 tensors stay compact
    for decode (banyan's AVX2 kernel, up to 8 rows) with a float16 copy for wider batches (prefill), the rest
    float16; a bf16/fp16 checkpoint goes to float16. Otherwise the model's own dtype. A pre-quantized checkpoint
    (AWQ, GPTQ, compressed-tensors) keeps its integer layers, mixed as a GGUF file's are where that applies."""
    holds = "a GGUF file" if is_gguf else prequantized.description if prequantized is not None else "not quantized"
    if asked in FILE_METHODS and asked != ("gguf" if is_gguf else prequantized and prequantized.method):
        raise InvalidParameterError("quantization", f"{asked} keeps a checkpoint's own {asked} tensors; this "
                                    f"checkpoint is {holds}")
    if prequantized is not None:
        method = prequantized_method(asked, prequantized)
        return Choice(method, mix_fp16=method is not None and asked is None and _compact_mix(device, dtype))
    if asked == "none":
        return Choice(None)
    if asked is not None:
        return Choice(asked)
    if not fbgemm_fp16_works(device, dtype) or not (is_gguf or checkpoint_dtype in ("bfloat16", "float16")):
        return Choice(None)
    return Choice("gguf", mix_fp16=True) if is_gguf and _compact_mix(device, dtype) else Choice("fp16")


def _compact_mix(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compact int4/int8 layers take banyan's kernel (AVX2, or AVX-512 VNNI where the CPU has it) for
    decode and float16 copies for prefill here."""
    return fbgemm_fp16_works(device, dtype) and cpu_gemv.vector_cpu() and cpu_gemv.load() is not None


def plan_formats(model: nn.Module, method: str, group_size: int = 32,
                 file_formats: dict[str, WeightFormat] | None = None,
                 fill: WeightFormat | None = None) -> dict[str, WeightFormat]:
    """The format of each linear layer to quantize, by module name. file_formats (for FILE_METHODS): the
    format of each checkpoint tensor the file keeps compact, by its Hugging Face name (None: a float checkpoint);
    fill: the format of the layers the file does not keep compact (None: the model's dtype)."""
    if method not in QUANTIZATION_METHODS:
        raise UnknownChoiceError("quantization", method, [*QUANTIZATION_METHODS, "none"])
    if method in FILE_METHODS and file_formats is None:
        raise InvalidParameterError("quantization", f"{method} keeps a checkpoint's own {method} tensors compact: the "
                                    f"model is not {'a .gguf' if method == 'gguf' else f'a {method} checkpoint'}")
    if method == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidParameterError("quantization_group_size", f"must be one of {INT4_GROUP_SIZES}, got {group_size}")
    tied = model.arch.tie_word_embeddings
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if method in FILE_METHODS:
                fmt = _file_format(name, module, file_formats, tied) or fill
            else:
                fmt = _format(name, method, group_size)
            if fmt is not None:
                _check_fits(name, module, fmt)
                plan[name] = fmt
    return plan


def _format(name: str, method: str, group_size: int) -> WeightFormat | None:
    if name == "lm_head" and method != "fp16":
        return INT8 if method != "fp8" else None
    return WeightFormat(method, group_size if method == "int4" else 0)


def _file_format(name: str, module: nn.Linear, file_formats: dict[str, WeightFormat], tied: bool) -> WeightFormat | None:
    """The file's format when every shard of the layer has it; None (dequantized) when they differ."""
    paths = ["model.embed_tokens"] if name == "lm_head" and tied else list(checkpoint_shards(name, module))
    found = {file_formats.get(f"{path}.weight") for path in paths}
    if len(found) != 1 or None in found:
        return None
    return INT8 if name == "lm_head" and tied else found.pop()  # only int8 rows can serve as embeddings too


def _check_fits(name: str, module: nn.Linear, fmt: WeightFormat) -> None:
    if fmt.kind == "int4" and module.in_features % fmt.group_size:
        raise InvalidParameterError(
            "quantization_group_size", f"{name} has {module.in_features} inputs, not a multiple of {fmt.group_size}"
        )


def quantize_linears(model: nn.Module, plan: dict[str, WeightFormat], wide_fp16: bool = False,
                     batch_invariant: bool = False, wide_bf16: bool = False) -> None:
    """Swap the planned nn.Linear layers for empty QuantizedLinear ones; tie the embeddings to an int8 or
    fp16 lm_head. wide_fp16: int8/int4 layers keep a float16 copy for batches wider than the CPU kernel's;
    wide_bf16 (CPUs with AMX): a bf16 copy for prefill-sized calls; batch_invariant: int8/int4 layers send every row
    through the CPU kernel instead (no copy)."""
    for name, fmt in plan.items():
        layer = QuantizedLinear.like(model.get_submodule(name), fmt)
        layer.wide_fp16, layer.batch_invariant, layer.wide_bf16 = wide_fp16, batch_invariant, wide_bf16
        _replace(model, name, layer)
    if model.arch.tie_word_embeddings and plan.get("lm_head") in (INT8, FP16):
        model.model.embed_tokens = QuantizedEmbedding(model.lm_head)


def why_not_invariant_by_default(model: nn.Module, device: torch.device, dtype: torch.dtype,
                                 plan: dict[str, WeightFormat], attention: str, lora: bool, parallel: bool,
                                 amx: bool = False) -> str | None:
    """None where batch-invariant mode goes on unasked, else why it stays off. On where its cost was measured at
    most 10% (docs/quantization.md, 2-vCPU AVX2 EPYC: the default GGUF mix 3% offline, float32 models about 5%,
    long prefills faster; a Zen 4 EPYC with AVX-512 VNNI: none measurable): an x86 CPU with AVX2 or AVX-512 (the
    vector ISA torch reports), banyan's kernels built, a float32 model whose linear layers are
    float32, int8 or int4 with inputs in blocks of 32, the torch attention backend, no LoRA (the adapters' matmuls
    are torch's), no tensor or pipeline parallelism (their collectives sum in their own order). Not on a CPU with AMX
    tiles (`amx`): there a bf16 copy's prefill was 1.74x the integer kernels' and offline 1.17x (a cost over 10%)."""
    reasons = (
        (device.type != "cpu", "not a CPU"),
        (not cpu_gemv.vector_cpu(), "its cost is measured on x86 CPUs with AVX2 or AVX-512, not this one"),
        (dtype != torch.float32, f"{dtype} activations"),
        (attention != "torch", f"the {attention} attention backend"),
        (lora, "LoRA adapters"),
        (parallel, "tensor or pipeline parallelism"),
        (amx and device.type == "cpu", "AMX tiles: prefill in bf16 through them is 1.7x the integer kernels'"),
        (any(fmt.kind not in ("int4", "int8") for fmt in plan.values()), "fp16 or fp8 weights"),
        (any(isinstance(m, nn.Linear) and m.in_features % 32 for m in model.modules()), "a layer's inputs are not in blocks of 32"),
    )
    blocker = next((why for applies, why in reasons if applies), None)
    if blocker is None and cpu_gemv.load() is None:
        return "banyan's CPU kernels are not built here"
    return blocker


def use_fixed_order(model: nn.Module) -> cpu_gemv.CpuKernels:
    """Batch-invariant mode, after loading: float nn.Linear layers multiply through banyan's CPU kernel, each row
    in one fixed order (quantized ones already do, from quantize_linears); returns the kernels, whose attention
    the torch backend then uses too. Raises InvalidParameterError where a layer has no such kernel here."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and cpu_gemv.supported(module.weight.device, module.weight.dtype, module.in_features):
            _replace(model, name, FixedOrderLinear(module, cpu_gemv.load()))
        elif isinstance(module, nn.Linear) or isinstance(module, QuantizedLinear) and module.gemv is None:
            raise InvalidParameterError("batch_invariant", f"{name}: no fixed-order kernel for it here (banyan's CPU "
                                        "kernels need an x86 CPU with AVX2, a float32 model, none/fp16/int8/int4 weights)")
    return cpu_gemv.load()


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)


def finish_loading(model: nn.Module) -> None:
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.finish_loading()
    cpu_int = [layer for layer in layers if layer.fmt.kind in ("int8", "int4") and not layer.packed_kernels
               and layer.device.type == "cpu"]
    if any(layer.gemv is None for layer in cpu_int):
        logger.warning("int8/int4 weights on a CPU without AVX-512 nor banyan's AVX2 kernel: each matmul "
                       "dequantizes; this saves memory, and decodes slower than float32")


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight, tied ones counted once (buffers such as RoPE tables included)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total + sum(m.quantized_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))

