"""Steps of a few rows on a CPU with every decoder layer in one C call (banyan/kernels/cpu_decode_layers.c).

A batch-1 decode step of the default model ran nine ctypes calls a layer from Python (norm, the four matmuls,
RoPE + KV store, attention, SiLU * up, the residual adds), with the module calls, checks and output tensors
around each: about half of the step. For a step of a few rows (MAX_ROWS, or WIDE_ROWS where no linear layer keeps a
float16 copy for wide calls) the same kernels run in the same order
from C, so the hidden states have the same bits as the module path; Python does the embedding, one call, and
the final norm:

    embed_tokens(ids) -> decode_layers(x, every layer) -> norm(x)      (like DecodeGraphs.run on a GPU)

It serves a plain pre-norm decoder (DecoderLayer of RopeAttention without q/k norms and a SiLU GatedMLP) whose
four linear layers a layer all run banyan's narrow CPU kernels (int4, int8, or fp16 in batch-invariant mode),
float32 activations, a float32, float16 or fp8 KV cache, the torch attention backend with its fused kernels, and no
hooks (tensor parallelism), no LoRA (the runner does not ask then). Anything else keeps the module path.
"""

from __future__ import annotations

import itertools

import torch

from banyan.forward_batch import ForwardBatch
from banyan.kernels import cpu_decode, cpu_decode_layers, cpu_gemv
from banyan.kernels.cpu_decode_layers import LinearOperands
from banyan.layers.attention.torch_backend import TorchAttentionBackend, paged_rows
from banyan.models.blocks import CausalLM, DecoderLayer, GatedMLP, RopeAttention
from banyan.quantization.linear import BF16_ROWS, QuantizedLinear

MAX_ROWS = 8
"""Rows a step may have where a linear layer keeps a float16 copy for wider calls (QuantizedLinear takes its narrow
kernel up to there)."""
WIDE_ROWS = 256
"""Rows a step may have where every linear layer takes its narrow kernel at any width (int4 layers; every layer in
batch-invariant mode): 16 decode streams ran the module path's ~60 Python-side ops a layer before. Where layers keep
bf16 copies (AMX), fewer than BF16_ROWS: wider steps take the copies through the module path."""


class CpuDecodeStep:
    def __init__(self, model: CausalLM, kv_caches, kernel: cpu_decode_layers.DecodeLayers, amx_tiles: bool = False,
                 kv_scale: float = 1.0):
        """amx_tiles: decode rows over a shared prompt's pages attend on AMX-BF16 tiles (the backend's amx_tiles);
        kv_scale: an fp8 cache's (the backend's)."""
        arch, attn = model.arch, model.model.layers[0].self_attn
        self.model, self.kernel = model, kernel
        self.layers = (cpu_decode_layers.Layer * len(model.model.layers))(
            *(_layer(layer, k, v) for layer, (k, v) in zip(model.model.layers, kv_caches, strict=True)))
        rotary = attn.rotary_emb
        self.step = cpu_decode_layers.Step(
            hidden=arch.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=arch.intermediate_size, page_size=kv_caches[0][0].shape[1], max_pos=rotary.cos.shape[0],
            eps=model.model.layers[0].input_layernorm.eps, scale=attn.scale, cos=rotary.cos.data_ptr(),
            sin=rotary.sin.data_ptr(), kv_kind=cpu_decode.kv_kind(kv_caches[0][0]), kv_scale=kv_scale,
            kv_inv_scale=1.0 / kv_scale, bf16_tiles=int(amx_tiles))
        linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, QuantizedLinear)]
        wide_copies, bf16_copies = (any(getattr(m, copy) is not None for m in linears) for copy in ("wide", "bf16"))
        self.max_rows = MAX_ROWS if wide_copies else BF16_ROWS - 1 if bf16_copies else WIDE_ROWS
        self.widest = max(arch.hidden_size, arch.intermediate_size, attn.q_size)
        self.width = 2 * arch.hidden_size + attn.q_size + 2 * attn.kv_size + attn.q_size + 3 * arch.intermediate_size
        self.work = torch.empty(0, dtype=torch.float32)  # both grown with the widest step (_grow_scratch)
        self.quant_scratch = torch.empty(0, dtype=torch.uint8)
        self.attn_scratch = torch.empty(0, dtype=torch.float32)  # grown with the longest context

    @classmethod
    def build(cls, model: torch.nn.Module, attn, kv_caches) -> CpuDecodeStep | None:
        """The step for this model where it serves (see the module docstring), else None."""
        kernel = cpu_decode_layers.load()
        gemv = cpu_gemv.load()
        if kernel is None or gemv is None or gemv.max_rows < MAX_ROWS or not _plain(model, attn, kv_caches):
            return None
        return cls(model, kv_caches, kernel, attn.amx_tiles(kv_caches[0][0], None), attn.kv_scale)

    def fits(self, fb: ForwardBatch) -> bool:
        return 0 < fb.num_tokens <= self.max_rows

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden states of the step's rows, [num_tokens, hidden], as CausalLM.forward computes them."""
        x = self.model.model.embed_tokens(fb.input_ids).contiguous()  # [num_tokens, hidden], a new tensor
        starts = [0, *itertools.accumulate(fb.query_lens)]  # the host copy: no read of query_start_loc
        rows = paged_rows(fb, starts)  # every row
        self._grow_scratch(fb.num_tokens)
        threads = torch.get_num_threads()
        room = cpu_decode.attention_scratch(threads, self.step.heads, self.step.kv_heads, rows.max_keys)
        if self.attn_scratch.numel() < room:
            self.attn_scratch = torch.empty(2 * room, dtype=torch.float32)
        s = self.step
        s.threads, s.positions, s.slots = threads, fb.positions.data_ptr(), fb.slot_mapping.data_ptr()
        s.tables, s.table_stride = rows.tables.data_ptr(), rows.tables.stride(0)
        s.rows, s.seq_of_row, s.row_positions = rows.rows.data_ptr(), rows.seq_of_row.data_ptr(), rows.positions.data_ptr()
        s.shared, s.max_keys, s.attn_scratch = rows.shared_ptr(), rows.max_keys, self.attn_scratch.data_ptr()
        self.kernel(self.layers, len(self.layers), s, x, self.work)
        return self.model.model.norm(x)

    def _grow_scratch(self, rows: int) -> None:
        """The activations' work space and x as int8 blocks (decode_layers' sizes) for `rows` rows."""
        if self.work.numel() < rows * self.width:
            self.work = torch.empty(rows * self.width, dtype=torch.float32)
            self.quant_scratch = torch.empty(rows * self.widest + 8 * rows * (self.widest // 32), dtype=torch.uint8)
            self.step.quant_scratch = self.quant_scratch.data_ptr()


def _plain(model: torch.nn.Module, attn, kv_caches) -> bool:
    """Whether every module of a decode step is one decode_layers reproduces (the module docstring's list)."""
    if not isinstance(model, CausalLM) or not isinstance(attn, TorchAttentionBackend) or attn.kernels is None:
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return False
    k_cache = kv_caches[0][0]
    if k_cache.dtype not in cpu_decode.KV_DTYPES or not k_cache.is_cpu or attn._kernels(k_cache) is None:
        return False
    layers, eps = model.model.layers, model.model.layers[0].input_layernorm.eps
    return len(layers) == len(kv_caches) and all(_plain_layer(layer, attn, eps) for layer in layers)


def _plain_layer(layer, attn, eps: float) -> bool:
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not RopeAttention or type(layer.mlp) is not GatedMLP:
        return False
    a, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (a.q_norm is None and a.attn is attn and a.rotary_emb.kernels is not None
            and a.rotary_emb.cos.dtype is torch.float32 and mlp.hidden_act in ("silu", "swish")
            and mlp.down_proj.in_features % 8 == 0 and all(n.kernels is not None and n.eps == eps for n in norms)
            and all(_operands(linear) is not None for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)))


def _operands(linear: torch.nn.Module) -> LinearOperands | None:
    narrow = linear.narrow_operands() if type(linear) is QuantizedLinear else None
    if narrow is None:
        return None
    kind, weight, scale, offset = narrow
    return LinearOperands(kind, weight, scale, offset, linear.fmt.group_size or 0, linear.bias, linear.out_features,
                          linear.in_features)


def _layer(layer: DecoderLayer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> cpu_decode_layers.Layer:
    a, mlp = layer.self_attn, layer.mlp
    linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return cpu_decode_layers.Layer(
        layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
        *(cpu_decode_layers.linear(_operands(linear)) for linear in linears),
        k_cache.data_ptr(), v_cache.data_ptr(), a.sliding_window or 0)

