"""LoRA applied to a built model from outside (as quantization is): each targeted linear layer is wrapped.

    LoRAModel.install(model, num_slots, max_rank)   after the weights are loaded: q/k/v (qkv_proj), o_proj,
                                                    gate/up (gate_up_proj), down_proj of every layer wrapped
    lora.load(slot, weights)                        copy an adapter's tensors into slot `slot` of every layer
    with lora.bound(groups): model(fb, kv)          one forward with those rows' adapters

A LoRALinear sees only x (the model passes nothing else to a projection), so the runner binds the step's
row groups on the LoRAModel around the forward, and clears them after. Without a binding (base-only
steps, CUDA graph capture) a wrapped layer is its base layer plus one attribute test.

Merged layers share one A product for all their shards: shard j's A^T fills columns [j*R, j*R + r) of
lora_a, and its (scale * B)^T is its own lora_b[j], written into the shard's output columns:

    t = x @ lora_a            [rows, n*R]     = [ t_q | t_k | t_v ]   (R columns each)
    y[:, q columns] += t_q @ lora_b[0]        y[:, k columns] += t_k @ lora_b[1]      ...

(one block-diagonal B would read n times the weights a step needs: the bytes, not the flops, cost on a CPU.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from banyan.layers.linear import shard_rows
from banyan.lora.grouped import LoRAGroups
from banyan.lora.weights import AdapterWeights

WRAPPED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, owner: LoRAModel, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.base = base
        self.out_sizes = dict(getattr(base, "out_sizes", None) or {None: base.out_features})
        self.max_rank = max_rank
        self._owner = [owner]  # a list: not registered as a submodule
        width = len(self.out_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(num_slots, base.in_features, width, dtype=dtype, device=device))
        self.cols = [shard_rows(self.out_sizes, shard) for shard in self.out_sizes]  # each shard's output columns
        for j, size in enumerate(self.out_sizes.values()):
            self.register_buffer(f"lora_b{j}", torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device))
        self.lora_b = [getattr(self, f"lora_b{j}") for j in range(len(self.out_sizes))]
        self.filled = [False] * num_slots  # slots where this layer has weights (an adapter may skip it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self._owner[0].groups
        if groups is None or not any(self.filled[s] for s in groups.slots):
            return y
        return groups.add_deltas(y, x, self.lora_a, self.lora_b, self.cols)

    @torch.no_grad()
    def load(self, slot: int, shards: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This layer's part of one adapter (shard -> (A [r, in], scale * B [out_shard, r])) into `slot`."""
        self.lora_a[slot].zero_()
        R = self.max_rank
        for j, shard in enumerate(self.out_sizes):
            self.lora_b[j][slot].zero_()
            if shard not in shards:
                continue
            a, b = shards[shard]
            r = a.shape[0]
            self.lora_a[slot, :, j * R : j * R + r].copy_(a.t())
            self.lora_b[j][slot, :r].copy_(b.t())
        self.filled[slot] = bool(shards)


class LoRAModel:
    """The wrapped layers of one model and the row groups of the forward in progress."""

    def __init__(self, layers: dict[str, LoRALinear], device: torch.device):
        self.layers = layers  # module path -> wrapper
        self.device = device
        self.groups: LoRAGroups | None = None

    @classmethod
    def install(cls, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> LoRAModel:
        """Wrap the targeted projections of every decoder layer of `model` (its weights loaded already)."""
        lora = cls({}, device)
        for i, layer in enumerate(model.model.layers):
            for path in WRAPPED:
                parent_name, name = path.split(".")
                parent = getattr(layer, parent_name)
                wrapper = LoRALinear(getattr(parent, name), lora, num_slots, max_rank, dtype, device)
                setattr(parent, name, wrapper)
                lora.layers[f"model.layers.{i}.{path}"] = wrapper
        return lora

    def prepare(self, batch) -> LoRAGroups | None:
        """Before the runner lays out a step (a Batch): copy in the adapters the scheduler swapped in, order the
        requests by adapter slot (base-model requests first; the order of a batch's requests is free), and return
        the row groups; None when every row runs the base model."""
        for slot, weights in batch.lora_loads:
            self.load(slot, weights)

        def slot_of(item) -> int:
            return batch.lora_slots[item.request.lora_id] if item.request.lora_id else -1

        batch.scheduled.sort(key=slot_of)
        groups: list[tuple[int, int, int]] = []  # (slot, first row, end row)
        row = 0
        for item in batch.scheduled:
            slot, end = slot_of(item), row + item.num_new_tokens
            if slot >= 0 and groups and groups[-1][0] == slot:
                groups[-1] = (slot, groups[-1][1], end)
            elif slot >= 0:
                groups.append((slot, row, end))
            row = end
        return LoRAGroups.build(groups, self.device) if groups else None

    def load(self, slot: int, weights: AdapterWeights) -> None:
        for path, layer in self.layers.items():
            layer.load(slot, weights.modules.get(path, {}))

    @contextlib.contextmanager
    def bound(self, groups: LoRAGroups) -> Iterator[None]:
        self.groups = groups
        try:
            yield
        finally:
            self.groups = None

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for layer in self.layers.values() for p in (layer.lora_a, *layer.lora_b))
