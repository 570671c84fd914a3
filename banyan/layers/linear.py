"""MergedLinear: one matmul for several checkpoint projections stacked by rows (q/k/v, gate/up).

    weight rows:  [ q_proj | k_proj | v_proj ]      out_sizes = {"q_proj": H*D, "k_proj": KV*D, "v_proj": KV*D}
                  0        H*D      (H+KV)*D  (H+2KV)*D

The checkpoint keeps each projection separate; `checkpoint_shards` tells the loader where each goes.
A quantized layer (banyan.quantization.QuantizedLinear) carries the same out_sizes.
"""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, out_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes.values()), bias=bias)
        self.out_sizes = dict(out_sizes)

    def shard_rows(self, name: str) -> slice:
        """Rows of weight (and bias) that hold checkpoint projection `name`."""
        return shard_rows(self.out_sizes, name)


def shard_rows(out_sizes: dict[str, int], name: str) -> slice:
    start = 0
    for shard, size in out_sizes.items():
        if shard == name:
            return slice(start, start + size)
        start += size
    raise KeyError(name)


def checkpoint_shards(path: str, module: nn.Module) -> dict[str, slice]:
    """{checkpoint module path: rows} for the module at `path`; merged layers answer for each shard:
    `model.layers.0.self_attn.qkv_proj` -> {`model.layers.0.self_attn.q_proj`: rows 0..H*D, ...}."""
    out_sizes = getattr(module, "out_sizes", None)
    if not out_sizes:
        return {path: slice(0, None)}
    parent = path.rpartition(".")[0]
    return {f"{parent}.{shard}": shard_rows(out_sizes, shard) for shard in out_sizes}
