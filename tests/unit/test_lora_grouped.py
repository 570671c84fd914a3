"""The grouped low-rank product adds each row's own adapter delta, x @ A^T @ (scale B)^T, and nothing to base rows,
whichever way it runs (equal groups as views, padded, per-group segments), whatever slots the groups use."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from banyan.layers.linear import MergedLinear
from banyan.lora.grouped import LoRAGroups
from banyan.lora.layers import LoRAModel

IN, OUT, SLOTS, R = 12, 10, 4, 3


def reference(x, lora_a, lora_b, cols, row_slot):
    """Row by row: the delta of the row's slot (None: the base model, no delta), shard j's B into its columns."""
    out = torch.zeros(len(row_slot), OUT)
    for i, s in enumerate(row_slot):
        if s is not None:
            for j, (b, c) in enumerate(zip(lora_b, cols)):
                out[i, c] += x[i] @ lora_a[s][:, j * R : (j + 1) * R] @ b[s]
    return out


def groups_of(row_slot: list[int | None]) -> list[tuple[int, int, int]]:
    """(slot, first row, end row) of each run of rows with one slot, as the runner's ordering leaves them."""
    groups, row = [], 0
    for slot in row_slot:
        if slot is not None and groups and groups[-1][0] == slot and groups[-1][2] == row:
            groups[-1] = (slot, groups[-1][1], row + 1)
        elif slot is not None:
            groups.append((slot, row, row + 1))
        row += 1
    return groups


@pytest.mark.parametrize("row_slot, strategy", [
    ([None, 0, 0, 1, 1, 2, 2, 3, 3], "equal"),  # decode spread evenly; slots 0..3 consecutive (views)
    ([None, None, 3, 3, 1, 1], "equal"),  # slots 3 then 1: an index
    ([None, 2, 2, 2, 0, 0, 1, 1, 1], "padded"),  # uneven but cheap to pad
    ([1] * 20 + [3, 0], "segments"),  # a long group beside short ones
    ([None, 3, 3, 3], "equal"),  # one group
])
@pytest.mark.parametrize("sizes", [(OUT,), (6, 2, 2)])  # a plain layer; a merged one (q, k, v)
def test_grouped_product_equals_row_by_row(row_slot, strategy, sizes):
    torch.manual_seed(0)
    x = torch.randn(len(row_slot), IN)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    cols = [slice(start, start + size) for start, size in zip(starts, sizes)]
    lora_a = torch.randn(SLOTS, IN, len(sizes) * R)
    lora_b = [torch.randn(SLOTS, R, size) for size in sizes]
    groups = LoRAGroups.build(groups_of(row_slot), torch.device("cpu"))
    assert groups.strategy == strategy
    y = groups.add_deltas(torch.zeros(len(row_slot), OUT), x, lora_a, lora_b, cols)
    torch.testing.assert_close(y, reference(x, lora_a, lora_b, cols, row_slot))


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
        with lora.bound(LoRAGroups.build([(1, 1, 3)], torch.device("cpu"))):
            got = wrapped(x)
        assert torch.equal(wrapped(x), base)  # unbound: the base layer alone
    expected = base.clone()
    expected[1:3, 6:8] += x[1:3] @ a.t() @ b.t()
    torch.testing.assert_close(got, expected)
