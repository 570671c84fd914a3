"""The grouped low-rank product: one batch, rows of several adapters (and of the base model), one product per group.

For a wrapped linear layer, every resident adapter's A^T and (scale * B)^T are stacked by slot:

    lora_a [num_slots, in, n*R]     lora_b [num_slots, n*R, out]     R = max_lora_rank, n = merged shards (qkv: 3)

and a step adds, for each group g of rows running adapter slot s_g (base-model rows belong to no group):

    y[rows_g] += (x[rows_g] @ lora_a[s_g]) @ lora_b[s_g]

Two ways to run it, chosen once per step (LoRAGroups.build), the same sums either way:
  padded    rows as a [G, M] index (groups padded to the largest, M rows; padding masked to 0):
            gather, bmm, bmm, index_add: four kernels per layer whatever G. Used when padding costs
            less than the real rows (decode batches, one adapter's prefill).
  segments  rows sorted by group, one pair of matmuls per group: for a long prefill beside a few
            decodes, where padding every group to the prefill's length would waste work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAGroups:
    slots: list[int]  # slot of each group, ascending
    rows: torch.Tensor  # padded: [G, M] row indices (padding -> row 0); segments: [N] rows sorted by group
    mask: torch.Tensor | None  # padded with padding: [G, M, 1], 1 for real rows; else None
    bounds: list[int] | None  # segments: group g is rows[bounds[g]:bounds[g+1]]; padded: None
    slot_index: torch.Tensor | None  # padded: the slots as a tensor, None when they are 0..G-1 (a view suffices)

    @classmethod
    def build(cls, slot_rows: dict[int, list[int]], device: torch.device) -> LoRAGroups:
        """slot -> the batch rows that run its adapter (non-empty lists)."""
        slots = sorted(slot_rows)
        sizes = [len(slot_rows[s]) for s in slots]
        longest, total = max(sizes), sum(sizes)
        if longest * len(slots) > 2 * total:
            flat = [r for s in slots for r in slot_rows[s]]
            bounds = [0]
            for size in sizes:
                bounds.append(bounds[-1] + size)
            return cls(slots, torch.tensor(flat, dtype=torch.long, device=device), None, bounds, None)
        padded = [slot_rows[s] + [0] * (longest - len(slot_rows[s])) for s in slots]
        rows = torch.tensor(padded, dtype=torch.long, device=device)
        mask = None
        if longest * len(slots) != total:
            mask = torch.tensor([[[1.0]] * n + [[0.0]] * (longest - n) for n in sizes], device=device)
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        index = None if contiguous else torch.tensor(slots, dtype=torch.long, device=device)
        return cls(slots, rows, mask, None, index)

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """y += each group's low-rank product, in place; y [N, out], x [N, in]."""
        if self.bounds is not None:
            return self._add_segments(y, x, lora_a, lora_b)
        a, b = self._stacked(lora_a), self._stacked(lora_b)  # [G, in, n*R], [G, n*R, out]
        t = torch.bmm(x[self.rows], a)  # [G, M, n*R]
        if self.mask is not None:
            t = t * self.mask.to(t.dtype)
        d = torch.bmm(t, b)  # [G, M, out]
        return y.index_add_(0, self.rows.flatten(), d.flatten(0, 1).to(y.dtype))

    def _stacked(self, w: torch.Tensor) -> torch.Tensor:
        if self.slot_index is not None:
            return w.index_select(0, self.slot_index)
        return w.narrow(0, self.slots[0], len(self.slots))

    def _add_segments(self, y, x, lora_a, lora_b) -> torch.Tensor:
        xs = x[self.rows]  # [N, in], sorted by group
        for g, slot in enumerate(self.slots):
            lo, hi = self.bounds[g], self.bounds[g + 1]
            d = (xs[lo:hi] @ lora_a[slot]) @ lora_b[slot]  # [rows_g, out]
            y.index_add_(0, self.rows[lo:hi], d.to(y.dtype))
        return y
