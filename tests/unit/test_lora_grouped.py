"""The grouped low-rank product adds each row's own adapter delta, x @ A^T @ (scale B)^T, and nothing to base rows,
whichever way it runs (padded bmm or per-group segments), whatever slots the groups use."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from banyan.layers.linear import MergedLinear
from banyan.lora.grouped import LoRAGroups
from banyan.lora.layers import LoRAModel

IN, OUT, SLOTS, R = 12, 10, 4, 3


def reference(x, lora_a, lora_b, row_slot):
    """Row by row: the delta of the row's slot (None: the base model, no delta)."""
    return torch.stack([torch.zeros(OUT) if s is None else x[i] @ lora_a[s] @ lora_b[s] for i, s in enumerate(row_slot)])


@pytest.mark.parametrize("row_slot", [
    [0, 0, 1, 1, None, 2, 2, 3, 3],  # balanced: padded, no padding, slots 0..3 (a view)
    [2, None, 2, 0, 2, 0],  # unbalanced but cheap to pad: padded with a mask, slots {0, 2} (an index)
    [1] * 20 + [3, None, 0],  # a long group beside short ones: segments
    [None, 3, None],  # one group
])
def test_grouped_product_equals_row_by_row(row_slot):
    torch.manual_seed(0)
    x = torch.randn(len(row_slot), IN)
    lora_a, lora_b = torch.randn(SLOTS, IN, R), torch.randn(SLOTS, R, OUT)
    slot_rows: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slot):
        if slot is not None:
            slot_rows.setdefault(slot, []).append(row)
    groups = LoRAGroups.build(slot_rows, torch.device("cpu"))
    y = groups.add_deltas(torch.zeros(len(row_slot), OUT), x, lora_a, lora_b)
    torch.testing.assert_close(y, reference(x, lora_a, lora_b, row_slot))


def test_strategies_are_chosen_by_padding_cost():
    cpu = torch.device("cpu")
    assert LoRAGroups.build({0: [0, 1], 1: [2, 3]}, cpu).bounds is None  # padded
    assert LoRAGroups.build({0: list(range(20)), 1: [20], 3: [21]}, cpu).bounds == [0, 20, 21, 22]  # segments


def test_a_merged_layer_puts_each_shard_delta_in_its_own_columns():
    """qkv as one matmul: an adapter on k only changes k's columns, by x @ A_k^T @ B_k^T."""
    torch.manual_seed(1)
    layer = MergedLinear(IN, {"q_proj": 6, "k_proj": 2, "v_proj": 2})
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].self_attn = nn.Module()
    model.model.layers[0].self_attn.qkv_proj = layer
    model.model.layers[0].self_attn.o_proj = nn.Linear(IN, IN)
    model.model.layers[0].mlp = nn.Module()
    model.model.layers[0].mlp.gate_up_proj = MergedLinear(IN, {"gate_proj": 4, "up_proj": 4})
    model.model.layers[0].mlp.down_proj = nn.Linear(4, IN)
    lora = LoRAModel.install(model, num_slots=2, max_rank=R, dtype=torch.float32, device=torch.device("cpu"))
    a, b = torch.randn(2, IN), torch.randn(2, 2)  # rank 2 below the maximum 3
    lora.layers["model.layers.0.self_attn.qkv_proj"].load(1, {"k_proj": (a, b)})
    x = torch.randn(3, IN)
    wrapped = model.model.layers[0].self_attn.qkv_proj
    with torch.no_grad():
        base = layer(x)
        with lora.bound(LoRAGroups.build({1: [0, 2]}, torch.device("cpu"))):
            got = wrapped(x)
        assert torch.equal(wrapped(x), base)  # unbound: the base layer alone
    expected = base.clone()
    expected[[0, 2], 6:8] += x[[0, 2]] @ a.t() @ b.t()
    torch.testing.assert_close(got, expected)
