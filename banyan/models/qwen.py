"""Qwen2 and Qwen3: Llama's network with bias on q/k/v (Qwen2) or per-head q/k RMSNorm (Qwen3).

Qwen3's q_norm/k_norm normalize each head over head_dim before RoPE; its head_dim is explicit
(not hidden_size / num_heads). Sliding-window layers (use_sliding_window) are not implemented:
they need max_window_layers, which no released checkpoint enables.
"""

from __future__ import annotations

from banyan.config import ModelArch
from banyan.layers.attention import AttentionBackend
from banyan.layers.rotary import RotaryEmbedding
from banyan.models.blocks import CausalLM, DecoderLayer, GatedMLP, RopeAttention


class Qwen2ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, attn_backend: AttentionBackend) -> DecoderLayer:
        attention = RopeAttention(arch, rotary, attn_backend, qkv_bias=True)
        mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        return DecoderLayer(attention, mlp, arch.hidden_size, arch.rms_norm_eps)


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, attn_backend: AttentionBackend) -> DecoderLayer:
        attention = RopeAttention(
            arch, rotary, attn_backend, qkv_bias=arch.attention_bias, o_bias=arch.o_proj_bias, qk_norm=True
        )
        mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        return DecoderLayer(attention, mlp, arch.hidden_size, arch.rms_norm_eps)
