"""MergedLinear: one matmul for several checkpoint projections stacked by rows (q/k/v, gate/up).

    weight rows:  [ q_proj | k_proj | v_proj ]      out_sizes = {"q_proj": H*D, "k_proj": KV*D, "v_proj": KV*D}
                  0        H*D      (H+KV)*D  (H+2KV)*D

The checkpoint keeps each projection separate; `shard_rows(name)` tells the loader where it goes.
"""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, out_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes.values()), bias=bias)
        self.out_sizes = dict(out_sizes)

    def shard_rows(self, name: str) -> slice:
        """Rows of weight (and bias) that hold checkpoint projection `name`."""
        start = 0
        for shard, size in self.out_sizes.items():
            if shard == name:
                return slice(start, start + size)
            start += size
        raise KeyError(name)
