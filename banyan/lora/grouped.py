"""The grouped low-rank product: one batch, rows of several adapters (and of the base model), one product per group.

For a wrapped linear layer, every resident adapter's A^T and (scale * B)^T are stacked by slot:

    lora_a [num_slots, in, n*R]      lora_b[j] [num_slots, R, out_j]      R = max_lora_rank, n = merged shards (qkv: 3)

shard j's B applied to its R columns of x @ A, into its own output columns cols[j] (layers.py draws it).

The runner orders a step's requests by adapter slot (LoRAModel.prepare), so each group is a run of rows, base-model
rows first (they belong to no group):

    rows:   [ base ... | slot 0: bounds[0]..bounds[1] | slot 3: bounds[1]..bounds[2] | ... ]

and a step adds, for each group g of rows [lo_g, hi_g) running adapter slot s_g:

    t = x[lo_g:hi_g] @ lora_a[s_g];   y[lo_g:hi_g, cols[j]] += t[:, j*R:(j+1)*R] @ lora_b[j][s_g]   for each shard j

Three ways to run it, chosen once per step (LoRAGroups.build), the same sums each way:
  equal     every group has M rows: x and y viewed as [G, M, *], one bmm, then one baddbmm into y per shard,
            no gather or scatter (decode batches spread evenly over adapters; one adapter alone)
  padded    groups padded to the largest, M rows, through a [G, M] row index, padding masked to 0: gather,
            bmm, then bmm and index_add per shard, whatever G (uneven groups, when padding costs less than the rows)
  segments  per group on views, one matmul then one addmm per shard (a long prefill beside a few decodes: no
            group padded to its length)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAGroups:
    slots: list[int]  # slot of each group, in row order
    bounds: list[int]  # group g is rows [bounds[g], bounds[g + 1])
    strategy: str  # "equal", "padded" or "segments"
    rows: torch.Tensor | None = None  # padded: [G, M] row indices (padding -> the group's first row)
    mask: torch.Tensor | None = None  # padded: [G, M, 1], 1 for real rows
    slot_index: torch.Tensor | None = None  # equal/padded: the slots as an index, None when they run consecutively

    @classmethod
    def build(cls, slot_bounds: list[tuple[int, int, int]], device: torch.device) -> LoRAGroups:
        """slot_bounds: (slot, first row, end row) of each group, adjacent, in row order, each non-empty."""
        slots = [s for s, _, _ in slot_bounds]
        bounds = [slot_bounds[0][1]] + [end for _, _, end in slot_bounds]
        sizes = [end - start for _, start, end in slot_bounds]
        longest, total = max(sizes), sum(sizes)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        index = None if consecutive else torch.tensor(slots, dtype=torch.long, device=device)
        if min(sizes) == longest:
            return cls(slots, bounds, "equal", slot_index=index)
        if longest * len(slots) > 2 * total:
            return cls(slots, bounds, "segments")
        rows = [[start + min(j, end - start - 1) for j in range(longest)] for _, start, end in slot_bounds]
        mask = [[[1.0] if j < n else [0.0] for j in range(longest)] for n in sizes]
        return cls(slots, bounds, "padded", torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(mask, device=device), index)

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
                   cols: list[slice]) -> torch.Tensor:
        """y += each group's low-rank product, in place; y [N, out], x [N, in]; lora_b[j] writes columns cols[j]."""
        R = lora_b[0].shape[1]
        shards = [(j * R, b, c) for j, (b, c) in enumerate(zip(lora_b, cols))]
        if self.strategy == "segments":
            for g, slot in enumerate(self.slots):
                lo, hi = self.bounds[g], self.bounds[g + 1]
                t = x[lo:hi] @ lora_a[slot]  # [rows, n*R]
                for k, b, c in shards:
                    y[lo:hi, c].addmm_(t[:, k : k + R], b[slot])
            return y
        G, lo, hi = len(self.slots), self.bounds[0], self.bounds[-1]
        if self.strategy == "equal":
            M = (hi - lo) // G
            t = torch.bmm(x[lo:hi].reshape(G, M, -1), self._stacked(lora_a))  # [G, M, n*R]
            yv = y[lo:hi].view(G, M, -1)
            for k, b, c in shards:
                yv[..., c].baddbmm_(t[..., k : k + R], self._stacked(b))
            return y
        t = torch.bmm(x[self.rows], self._stacked(lora_a)) * self.mask.to(x.dtype)  # [G, M, n*R], padding zeroed
        for k, b, c in shards:
            y[:, c].index_add_(0, self.rows.flatten(), torch.bmm(t[..., k : k + R], self._stacked(b)).flatten(0, 1))
        return y

    def _stacked(self, w: torch.Tensor) -> torch.Tensor:
        if self.slot_index is not None:
            return w.index_select(0, self.slot_index)
        return w.narrow(0, self.slots[0], len(self.slots))
