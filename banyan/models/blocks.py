"""Shared decoder blocks: RoPE attention, gated MLP, pre-norm decoder layer, and the causal LM shell.

Parameter names follow Hugging Face checkpoints (`model.layers.0.self_attn.o_proj.weight`), except
the fused projections: q/k/v_proj live in `qkv_proj` and gate/up_proj in `gate_up_proj`;
`CausalLM.load_weights` routes checkpoint tensors into their rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from banyan.config import ModelArch
from banyan.errors import ModelLoadError
from banyan.layers.activation import gated_activation
from banyan.layers.attention import AttentionBackend
from banyan.layers.linear import MergedLinear, checkpoint_shards
from banyan.layers.norm import RMSNorm
from banyan.layers.rotary import RotaryEmbedding
from banyan.forward_batch import ForwardBatch

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_pages, page_size, num_kv_heads, head_dim]

_IGNORED = ("rotary_emb.inv_freq",)


class RopeAttention(nn.Module):
    """Multi-head attention with grouped KV heads, RoPE, optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(
        self,
        arch: ModelArch,
        rotary: RotaryEmbedding,
        attn_backend: AttentionBackend,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = MergedLinear(
            arch.hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}, bias=qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary  # shared by all layers
        self.attn = attn_backend

    def forward(self, x: torch.Tensor, kv_cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self._qkv(x)
        stored = self.rotary_emb.rotate_and_store(batch.positions, q, k, v, *kv_cache, batch.slot_mapping,
                                                  self.attn.kv_scale)
        if not stored:  # no fused CPU kernel here: rotate, and attention stores k and v
            q, k = self.rotary_emb(batch.positions, q, k)
        return self.o_proj(self.attend(q, k, v, kv_cache, batch, kv_stored=stored).flatten(1))  # [num_tokens, hidden]

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense half before attention: q, k, v of the rows, q and k rotated (piecewise CUDA graphs)."""
        q, k, v = self._qkv(x)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def attend(self, q, k, v, kv_cache: KVCache, batch: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        """Attention alone: stores k and v (unless kv_stored), [num_tokens, num_heads, head_dim] out."""
        return self.attn.forward(q, k, v, *kv_cache, batch, self.scale, self.sliding_window, kv_stored=kv_stored)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up as one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_mul = gated_activation(hidden_act, intermediate_size)  # [n, 2 inter] -> act(gate) * up [n, inter]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _through_bf16(x, self.gate_up_proj, self.down_proj):  # AMX prefill: the wide middle stays bf16
            return self.down_proj(self.act_mul(self.gate_up_proj(x.to(torch.bfloat16)))).to(x.dtype)
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))


def _through_bf16(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether every one of these linears computes x's rows on a bf16 copy of its weight (banyan's int8/int4 layers
    on CPUs with AMX tiles, prefill): what passes between them may then stay bf16, which their bf16 GEMMs round it to
    anyway, instead of widening to float32 and rounding back (the conversions were 31% of a 16 x 128 prefill's torch
    time, most of them the MLP's [rows, 2 x intermediate] and [rows, intermediate])."""
    rows = x.numel() // x.shape[-1]
    return x.dtype == torch.float32 and all(getattr(m, "serves_bf16", None) is not None and m.serves_bf16(rows)
                                            for m in linears)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: RopeAttention, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        return self.after_attention(x, self.self_attn(self.input_layernorm(x), kv_cache, batch))

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """x + attn_out, then + mlp(norm of that): the rest of the layer once attention's output is projected."""
        x, h = self.post_attention_layernorm.add_forward(x, attn_out)
        return x.add_(self.mlp(h))  # x: add_forward's new tensor


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm: HF's `model.*` submodule."""

    def __init__(self, arch: ModelArch, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only LM; subclasses say how to build one layer (`make_layer`)."""

    supports_sliding_window = False  # True where make_layer passes arch.sliding_window to attention

    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend):
        super().__init__()
        self.arch = arch
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        layers = [self.make_layer(arch, rotary, attn_backend) for _ in range(arch.num_hidden_layers)]
        self.model = DecoderModel(arch, layers)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, attn_backend: AttentionBackend) -> DecoderLayer:
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache], num_layers: int | None = None) -> torch.Tensor:
        """Hidden states of every new row, [num_tokens, hidden]; kv_caches holds one (k, v) per layer.
        num_layers: only the first layers, then the final norm (layer-skip self-speculation drafts so)."""
        x = self.model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        for layer, kv_cache in zip(layers, kv_caches[: len(layers)], strict=True):
            x = layer(x, kv_cache, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> fp32 logits [n, vocab]."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors in; raise ModelLoadError on unknown, misshapen or missing ones.
        A tensor may also come quantized (a compact GGUF tensor): a quantized layer keeps it as it is,
        a float parameter gets it dequantized."""
        targets = self._load_targets()
        loaded = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED):
                continue
            if name not in targets:
                raise ModelLoadError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            targets[name].load(tensor, name)
            loaded.add(targets[name].key)
        missing = [n for n, target in targets.items() if target.key not in loaded]
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def _load_targets(self) -> dict[str, _Target]:
        """Checkpoint name -> where its rows go. Tied weights answer to both names."""
        targets = {}
        for prefix, module in self.named_modules(remove_duplicate=False):
            params = dict(module.named_parameters(recurse=False, remove_duplicate=False))
            for path, rows in checkpoint_shards(prefix, module).items():
                for pname, param in params.items():
                    name = f"{path}.{pname}" if path else pname
                    targets[name] = _Target(functools.partial(_copy_rows, param, rows), (id(param), rows.start))
                if hasattr(module, "load_weight"):  # a quantized linear layer: it stores the weight itself
                    load = functools.partial(module.load_weight, rows)
                    targets[f"{path}.weight"] = _Target(load, (id(module), rows.start))
        if hasattr(self.lm_head, "load_weight") and self.arch.tie_word_embeddings:
            targets["model.embed_tokens.weight"] = targets["lm_head.weight"]  # the embeddings read lm_head's rows
        return targets


class _Target(NamedTuple):
    load: Callable[[torch.Tensor, str], None]  # (checkpoint tensor, its name)
    key: tuple[int, int | None]  # (storage id, first row): what counts as loaded


def _copy_rows(param: nn.Parameter, rows: slice, tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        tensor = tensor.dequantize(param.dtype)  # a compact GGUF tensor for a layer kept in floats
    dest = param.data[rows]
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}")
    dest.copy_(tensor)
