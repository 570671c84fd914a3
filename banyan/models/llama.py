"""Llama (Touvron et al., 2023) and Mistral: pre-norm decoder, RoPE attention with GQA, SwiGLU MLP.

Mistral is the same network; its config adds a sliding attention window.
"""

from __future__ import annotations

from banyan.config import ModelArch
from banyan.layers.attention import AttentionBackend
from banyan.layers.rotary import RotaryEmbedding
from banyan.models.blocks import CausalLM, DecoderLayer, GatedMLP, RopeAttention


class LlamaForCausalLM(CausalLM):
    supports_sliding_window = True

    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, attn_backend: AttentionBackend) -> DecoderLayer:
        attention = RopeAttention(
            arch,
            rotary,
            attn_backend,
            qkv_bias=arch.attention_bias,
            o_bias=arch.o_proj_bias,
            sliding_window=arch.sliding_window,
        )
        mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, bias=arch.mlp_bias)
        return DecoderLayer(attention, mlp, arch.hidden_size, arch.rms_norm_eps)


class MistralForCausalLM(LlamaForCausalLM):
    pass
