"""Rotary position embedding (Su et al., 2021), neox style (rotate_half), as Hugging Face Llama.

Token at position p rotates each pair (x[i], x[i + d/2]) by angle p * inv_freq[i]. cos/sin are
computed once in fp32 for every position up to the context length, as HF computes them per step,
then looked up by `positions` and cast to the activations' dtype.

Rope scaling kinds (config `rope_scaling.rope_type`): default, linear, llama3 (Llama 3.1), yarn.

On a float32 CPU model `rotate_and_store` rotates q and k in place and stores k and v in the KV cache in
one call of banyan's fused kernel (banyan/kernels/cpu_decode.c), which attention then need not do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from banyan.kernels import cpu_decode
from banyan.registry import Registry

ROPE_KINDS = Registry("rope_scaling")  # rope_type -> (dim, base, max_position, scaling) -> (inv_freq, attention scaling)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        scaling = rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        inv_freq, attention_scaling = ROPE_KINDS.get(kind)(head_dim, base, max_position, scaling)
        if "original_max_position_embeddings" in scaling and scaling.get("factor"):
            max_position = max(max_position, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq  # [max_position, head_dim / 2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)
        # Every layer rotates by the same positions in a forward: the first looks cos/sin up, the rest reuse
        # them while `positions` is the same tensor object (the runner builds a new one per forward, and a
        # CUDA graph's replay runs no Python; the reference held here keeps its id from being reused). A lookup
        # made outside a graph capture is never reused inside one: the graph would read that step's cos/sin
        # (a warm-up's, then freed memory) on every replay instead of looking its own positions up.
        self._looked_up: tuple[torch.Tensor, torch.dtype, bool, torch.Tensor, torch.Tensor] | None = None
        fits = head_dim % 16 == 0 and self.cos.shape[1] * 2 == head_dim  # the kernel's lanes, whole heads rotated
        self.kernels = cpu_decode.kernels_for(self.cos.device, torch.get_default_dtype()) if fits else None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, num_heads, head_dim]; k [num_tokens, num_kv_heads, head_dim]."""
        cos, sin = self._cos_sin(positions, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_scale: float = 1.0) -> bool:
        """The fused path where it serves (float32 rows, a float32, float16 or fp8 cache (its kv_scale) on a CPU):
        q and k rotated in place, k and v stored at slot_mapping, True. Else nothing done, False: the caller rotates
        and attention stores.
        q, k, v: [num_tokens, heads, head_dim], rows of one qkv output (heads contiguous within a row)."""
        if (self.kernels is None or q.dtype is not torch.float32 or k_cache.dtype not in cpu_decode.KV_DTYPES
                or not q.is_cpu):
            return False
        if not _heads_in_rows(q) or not _heads_in_rows(k) or not _heads_in_rows(v):
            return False
        self.kernels.rope_store(q, k, v, positions, self.cos, self.sin, k_cache, v_cache, slot_mapping, kv_scale)
        return True

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each row's angles, [num_tokens, 1, head_dim] in `dtype`."""
        hit, capturing = self._looked_up, graph_capturing(positions)
        if hit is not None and hit[0] is positions and hit[1] == dtype and hit[2] == capturing:
            return hit[3], hit[4]
        cos = self.cos.index_select(0, positions).to(dtype)  # [num_tokens, head_dim / 2]
        sin = self.sin.index_select(0, positions).to(dtype)
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        sin = torch.cat((sin, sin), dim=-1)[:, None, :]
        self._looked_up = (positions, dtype, capturing, cos, sin)
        return cos, sin


def graph_capturing(positions: torch.Tensor) -> bool:
    """Whether the work on `positions` is being captured into a CUDA graph."""
    return positions.is_cuda and torch.cuda.is_current_stream_capturing()


def _heads_in_rows(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads contiguous (rows may be apart)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _default(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim / 2]


@ROPE_KINDS.register("default")
def _default_kind(dim, base, max_position, scaling):
    return _default(dim, base), 1.0


@ROPE_KINDS.register("linear")
def _linear(dim, base, max_position, scaling):
    """Position interpolation: positions divided by `factor`."""
    return _default(dim, base) / scaling["factor"], 1.0


@ROPE_KINDS.register("llama3")
def _llama3(dim, base, max_position, scaling):
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = _default(dim, base)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


@ROPE_KINDS.register("yarn")
def _yarn(dim, base, max_position, scaling):
    """YaRN (Peng et al., 2023): interpolate low frequencies, extrapolate high ones, scale cos/sin."""
    old_len = scaling.get("original_max_position_embeddings", max_position)
    factor = scaling.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
