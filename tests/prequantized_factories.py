"""Tiny pre-quantized checkpoints, written as AutoAWQ, AutoGPTQ and llm-compressor write theirs.

No such checkpoint can be downloaded here, so these packers follow the tools' own packing loops (AutoAWQ's
WQLinear_GEMM.from_linear, AutoGPTQ's QuantLinear.pack, compressed-tensors' int-quantized compressor) on random
integer weights, independently of banyan's reader. Each linear layer of the decoder gets random q, zero points
and scales; the float weights they stand for, w = s * (q - z), make the reference transformers model.

    write_prequantized(path, "awq" | "gptq" | "gptq-v2" | "w8a8") -> (reference model, {layer path: float weight})
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tests.factories import make_hf_model, make_tokenizer

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # same input, same act-order
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Layout:
    method: str
    group_size: int  # -1: one scale per output channel
    act_order: bool = False
    symmetric: bool = False
    v2: bool = False  # GPTQ: zeros stored as they are (gptq_v2), not minus one

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "version": "gemm",
                    "zero_point": True, "modules_to_not_convert": None}
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.act_order,
                    "sym": self.symmetric, "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
                    "checkpoint_format": "gptq_v2" if self.v2 else "gptq"}
        return W8A8_CONFIG


LAYOUTS = {
    "awq": Layout("awq", 32),
    "gptq": Layout("gptq", 32, act_order=True, symmetric=True),  # the common desc_act + sym checkpoint, v1 zeros
    "gptq-v2": Layout("gptq", -1, v2=True),  # per channel, asymmetric, zeros as they are
    "gptq-128": Layout("gptq", 128, act_order=True),  # asymmetric; over 192 or 320 inputs the last group is short
    "w8a8": Layout("compressed-tensors", -1),
}

W8A8_CONFIG = {  # as llm-compressor's W8A8 (SmoothQuant + GPTQ) recipe saves it
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "actorder": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                              "group_size": None, "observer": None},
        "output_activations": None}},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
}  # fmt: skip


# -- AutoAWQ, version gemm ----------------------------------------------------------------------


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [out, in], zeros [out, groups] in 0..15, scales [out, groups] -> AutoAWQ's GEMM tensors:

        qweight [in, out/8]:  word j of row k = | q7 | q5 | q3 | q1 | q6 | q4 | q2 | q0 |   qi = q[k, 8j + i]
                                                 bits 31..28               bits 3..0
        (nibble i holds output 8j + AWQ_ORDER[i]); qzeros [groups, out/8] the same; scales [groups, out] fp16."""
    return {"qweight": _pack_columns(q.t(), AWQ_ORDER), "qzeros": _pack_columns(zeros.t(), AWQ_ORDER),
            "scales": scales.t().contiguous().half()}


def _pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, cols] of 4-bit values -> [rows, cols/8] int32: `qweight[:, col] |= values[:, col*8 + order[i]] << 4i`."""
    v = values.numpy().astype(np.uint32)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= v[:, col * 8 + order[i]] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32))


# -- AutoGPTQ -----------------------------------------------------------------------------------


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              v2: bool) -> dict[str, torch.Tensor]:
    """q [out, in], zeros and scales [out, groups], g_idx [in] (input k's group) -> AutoGPTQ's tensors:

        qweight [in/8, out]:  word r of column n = | q[n, 8r+7] | ... | q[n, 8r+1] | q[n, 8r] |   (bits 31..0)
        qzeros  [groups, out/8]: word c of a row = | z[8c+7] | ... | z[8c] |, v1 storing z - 1 (AutoGPTQ's
                `zeros -= 1`; masked to 4 bits here: AutoGPTQ's own cast of -1 spilled into the nibbles above)
        scales  [groups, out] fp16, g_idx [in] int32."""
    stored = zeros if v2 else (zeros - 1) & 15
    return {"qweight": _pack_columns(q).t().contiguous(), "qzeros": _pack_columns(stored.t()),
            "scales": scales.t().contiguous().half(), "g_idx": g_idx.to(torch.int32)}


def act_order_g_idx(in_features: int, group: int, generator: torch.Generator) -> torch.Tensor:
    """GPTQ with desc_act quantizes the inputs in a permuted order (by the Hessian's diagonal), `group` at a
    time: g_idx[perm[i]] = i // group, so each group's inputs are scattered."""
    perm = torch.randperm(in_features, generator=generator)
    g_idx = torch.empty(in_features, dtype=torch.long)
    g_idx[perm] = torch.arange(in_features) // group
    return g_idx


# -- llm-compressor / compressed-tensors, int-quantized --------------------------------------------


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [out, in] int8, scale [out] -> weight [out, in] int8 and weight_scale [out, 1] (strategy channel)."""
    return {"weight": q.to(torch.int8).contiguous(), "weight_scale": scale.reshape(-1, 1).half()}


# -- a whole checkpoint -------------------------------------------------------------------------


def random_layer(layout: Layout, out: int, cols: int, g_idx: torch.Tensor | None, gen: torch.Generator):
    """(packed tensors, the float weight they stand for)."""
    if layout.method == "compressed-tensors":
        q = torch.randint(-128, 128, (out, cols), generator=gen)
        scale = (torch.rand(out, generator=gen) * 0.0006 + 0.0008).half().float()
        return pack_w8a8(q, scale), scale[:, None] * q
    group = cols if layout.group_size == -1 else layout.group_size
    groups = -(-cols // group)  # AutoGPTQ: the last group takes what is left
    q = torch.randint(0, 16, (out, cols), generator=gen)
    zeros = torch.full((out, groups), 8) if layout.symmetric else torch.randint(0, 16, (out, groups), generator=gen)
    scales = (torch.rand(out, groups, generator=gen) * 0.015 + 0.01).half().float()
    if g_idx is None:
        g_idx = torch.arange(cols) // group
    weight = scales[:, g_idx] * (q - zeros[:, g_idx])
    packed = pack_awq(q, zeros, scales) if layout.method == "awq" else pack_gptq(q, zeros, scales, g_idx, layout.v2)
    return packed, weight


def write_prequantized(path: Path, name: str, seed: int = 0, split_orders: bool = False, **overrides):
    """A tiny Llama directory in layout `name` (LAYOUTS): config.json with its quantization_config, model.safetensors
    (packed decoder projections; embeddings, norms and lm_head in float16, as the tools leave them), tokenizer.
    split_orders: k_proj's act-order differs from q_proj's (a checkpoint banyan refuses).
    Returns the float32 transformers model holding exactly the weights the checkpoint stands for."""
    layout, path = LAYOUTS[name], Path(path)
    tokenizer = make_tokenizer()
    model = make_hf_model("llama", seed=seed, vocab_size=len(tokenizer), **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors, state = {}, {}
    for key, tensor in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        module = prefix.rpartition(".")[2]
        if module not in LINEARS or leaf != "weight":
            state[key] = tensor.half().float()
            tensors[key] = tensor.half()
            continue
        g_idx = None
        if layout.act_order:
            shared = f"{prefix.rpartition('.')[0]}.{SHARED_INPUT.get(module, module)}"
            g_idx = state.get(shared + ".g_idx") if not (split_orders and module == "k_proj") else None
            if g_idx is None:
                g_idx = act_order_g_idx(tensor.shape[1], layout.group_size, gen)
            state[f"{prefix}.g_idx"] = g_idx
        packed, weight = random_layer(layout, *tensor.shape, g_idx, gen)
        tensors.update({f"{prefix}.{part}": t for part, t in packed.items()})
        state[key] = weight
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(model.config.to_dict(), quantization_config=layout.quantization_config(), torch_dtype="float16",
                  dtype="float16", architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    model.load_state_dict({k: v for k, v in state.items() if not k.endswith(".g_idx")})
    return model
