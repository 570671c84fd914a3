"""Where and in what the runner computes: the device, the dtype and the attention backend, from the settings."""

from __future__ import annotations

import contextlib
import logging

import torch

from banyan.errors import InvalidParameterError
from banyan.layers.attention import AttentionBackend, choose_attention_backend, get_attention_backend

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidParameterError("device", "CUDA was asked for but torch sees no CUDA device")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise InvalidParameterError("device", f"must be cpu, cuda or auto, got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device, is_gguf: bool = False) -> torch.dtype:
    """`auto`: on a GPU the checkpoint's 16-bit dtype (bf16 for float32 ones); on a CPU with bf16 matmul
    tiles (AMX) bf16 for bf16/fp16 checkpoints, float32 elsewhere (exact; float32 checkpoints stay float32 everywhere
    on a CPU). A GGUF file stays float32 on every CPU: banyan's integer kernels serve its 4/8-bit tensors, which on
    an AMX Xeon decoded 6.5x and ran offline 1.4x as fast as bf16 (docs/quantization.md, "CPUs with AMX")."""
    if name == "auto":
        if device.type == "cpu":
            low_precision = not is_gguf and checkpoint_dtype in ("bfloat16", "float16")
            return torch.bfloat16 if low_precision and cpu_has_bf16_matmul() else torch.float32
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
    if name not in DTYPES:
        raise InvalidParameterError("dtype", f"must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def cpu_has_bf16_matmul() -> bool:
    """AMX tiles: bf16 matmuls several times faster than float32 (oneDNN). AVX512-BF16 alone is not enough: a
    bf16 model decoded 7.6x slower than the default float32 one with banyan's integer kernels on a Zen 4 EPYC
    (docs/quantization.md, "CPUs with AVX-512"), and was not faster than float32 on a Xeon without AMX."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return probe is not None and probe()


def attention_backend(name: str, device: torch.device, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend `name` (torch, triton or auto) resolves to here (choose_attention_backend, from this device's
    compute capability and whether triton imports); a warning when triton was wanted but cannot run."""
    capability = problem = None
    if device.type == "cuda" and name in ("auto", "triton"):
        from banyan.layers.attention.triton_backend import import_problem

        capability, problem = torch.cuda.get_device_capability(device), import_problem()
    chosen, why = choose_attention_backend(name, device.type, capability, problem, kv_dtype)
    if why is not None:
        logger.warning("attention backend %r: %s; using the 'torch' backend (no CUDA graphs)", name, why)
    return get_attention_backend(chosen, device, kv_dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _NoRandomInit(torch.overrides.TorchFunctionMode):
    """torch.nn.init's random fills as no-ops: the values a layer's constructor draws (nn.Linear's kaiming_uniform_,
    nn.Embedding's normal_) that the checkpoint overwrites, or that quantize_linears drops with the float layer."""

    SKIPPED = frozenset({torch.nn.init.kaiming_uniform_, torch.nn.init.uniform_, torch.nn.init.normal_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def without_random_init():
    """A model built inside leaves its parameters as allocated, not drawn at random: for a model whose every
    parameter the checkpoint then fills (load_weights refuses one that lacks any). The default model's 121 layers drew
    ~540 MB of random floats, 0.5-0.7 s of a ~5.7 s `LLM()` on a 2-vCPU Zen 4, in pages the quantized layers then
    dropped. Scoped to the thread that enters it (torch's function-mode stack), not a patch of torch.nn.init."""
    return _NoRandomInit()
